"""MultiNLI with BERT, minimal DDP: nli_dp_minimal.py with one process per device, started by torchrun.

Each process joins a process group, uses cuda:LOCAL_RANK, trains on its own 1/N of every global
batch (DistributedSampler, with set_epoch), and DDP averages the gradients during backward. Rank 0
prints. The evaluation is exact: DistributedEvalSampler gives each pair to exactly one rank and the
counts are summed. ddp.py is the full version.

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    torchrun --nproc_per_node=4 src/ch4/nli_ddp_minimal.py
    torchrun --nproc_per_node=2 src/ch4/nli_ddp_minimal.py --model path/to/bert --dataset pairs.jsonl

Lines marked `# STEP` are what this step changes in nli_dp_minimal.py.
"""
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common.cli import nli_parser, per_process_batch
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.nli import PairCollator, load_model_and_tokenizer, load_pairs, to_device
from common.samplers import DistributedEvalSampler


def main(args):
    launch = require_launcher("src/ch4/nli_ddp_minimal.py")  # STEP: rank, local rank, world size from torchrun or srun
    device = device_for(launch)  # STEP: cuda:LOCAL_RANK, never the global rank; one GPU per process
    timeout = timedelta(seconds=args.dist_timeout)  # STEP: how long a process waits for its peers
    if device.type != "cpu":  # STEP
        torch.get_device_module(device).set_device(device)  # STEP: device_id does not; object collectives use the current GPU
    with exit_if_peers_missing(launch, args.dist_timeout):  # STEP: a peer that never arrives ends the run in one sentence
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,  # STEP: nccl on GPUs, gloo on the CPU
                                timeout=timeout, device_id=device if device.type != "cpu" else None)  # STEP: NCCL: this GPU, connected now
        dist.barrier(async_op=True).wait(timeout=timeout)  # STEP: every peer has joined, or an error within the timeout
    torch.manual_seed(args.seed + launch.rank)  # STEP: own dropout masks per rank; DDP copies rank 0's weights to all

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    collate = PairCollator(tokenizer, args.max_length)
    batch_size = per_process_batch(args.batch_size, launch.world_size)  # STEP: each rank loads 1/N of the global batch
    train_sampler = DistributedSampler(train_pairs, seed=args.seed)  # STEP: a disjoint 1/N of the shuffled indices
    train_loader = DataLoader(train_pairs, batch_size=batch_size, sampler=train_sampler, collate_fn=collate)
    eval_loader = DataLoader(eval_pairs, batch_size=args.eval_batch_size,
                             sampler=DistributedEvalSampler(eval_pairs), collate_fn=collate)  # STEP

    model = model.to(device)
    model = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)  # STEP: all-reduce gradients in backward
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    print0(f"{processes(launch.world_size)} on {device.type}, global batch "  # STEP
           f"{args.batch_size} = {launch.world_size} x {batch_size}")  # STEP
    model.train()
    step, epoch = 0, 0
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)  # STEP: a new shuffle each epoch, the same on every rank
        for batch in train_loader:
            batch = to_device(batch, device)
            labels = batch.pop("labels")
            loss = nn.functional.cross_entropy(model(**batch).logits, labels)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            step += 1
            if step % 10 == 0:
                print0(f"step {step}: "  # STEP: mean over ranks
                       f"loss {sum_across_ranks(loss.item(), device=device)[0] / launch.world_size:.4f}")  # STEP
            if step == args.max_steps:
                break
        epoch += 1

    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for batch in eval_loader:
            batch = to_device(batch, device)
            labels = batch.pop("labels")
            correct += (model.module(**batch).logits.argmax(dim=-1) == labels).sum().item()  # STEP: no DDP collectives: a rank may have no batch
            seen += labels.numel()
    correct, seen = sum_across_ranks(correct, seen, device=device)  # STEP: every pair counted exactly once
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    dist.destroy_process_group()  # STEP


if __name__ == "__main__":
    parser = nli_parser(__doc__, precision=False, lr=3e-5, max_steps=300)  # fp32 only: data_parallel.py shows mixed precision
    main(parser.parse_args())
