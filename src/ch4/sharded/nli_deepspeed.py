"""MultiNLI with BERT and DeepSpeed ZeRO: nli_fsdp.py's sharded fine-tuning, by DeepSpeed's engine.

The same fine-tuning as ddp.py and nli_fsdp.py, with the sharding chosen by --zero-stage: 0 is plain
data parallelism, 1 shards AdamW's moments and fp32 state, 2 also the gradients, 3 also the
parameters (mnist_deepspeed.py is the same step on MNIST, with the engine's checkpoints). What
changes from nli_fsdp.py:
  - one config dict (common/deepspeed_config.py): the batch sizes, the stage, the precision, and
    "gradient_clipping": --max-grad-norm, which the engine applies to the whole averaged gradient;
  - deepspeed.initialize wraps the model, AdamW and the learning-rate schedule in one engine, which
    starts every rank from rank 0's weights (no broadcast) and shards per the stage (no wrap);
  - engine.backward(loss) and engine.step() replace the scaler, the clipping, optimizer_step and
    scheduler.step(): the engine steps the schedule itself, and not after an fp16 step it skipped;
  - with --precision bf16 or fp16 the engine holds 16-bit weights and fp32 masters, and its forward
    turns autocast off: no autocast around it (the token ids need no cast; the loss is taken in fp32).
Evaluation is nli_fsdp.py's: at stage 3 every forward all-gathers, so every rank runs the same batches.

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    # 4 GPUs, global batch 32 = 4 x 8
    torchrun --nproc_per_node=4 src/ch4/sharded/nli_deepspeed.py --zero-stage 3
    # CPU: gloo
    torchrun --nproc_per_node=2 src/ch4/sharded/nli_deepspeed.py --model path/to/bert --dataset pairs.jsonl
    # DeepSpeed's launcher, a config file
    deepspeed --num_gpus 4 src/ch4/sharded/nli_deepspeed.py --deepspeed-config ds_config.json
Needs DeepSpeed: pip install -e '.[deepspeed]'.

Lines marked `# STEP` are what this step changes in nli_fsdp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.cli import add_deepspeed_flags, nli_parser, per_process_batch
from common.deepspeed_config import deepspeed_config, require_deepspeed
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    exit_process,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.nli import load_model_and_tokenizer, load_pairs, nli_loader, to_device, tokenize_pairs
from common.precision import resolve_precision
from common.samplers import DistributedEvalSampler

deepspeed = require_deepspeed()  # STEP: import deepspeed, or one sentence on how to install it


def train_epoch(engine, loader, device, steps_left, progress):  # STEP
    """One pass over this process's share of the pairs, or fewer if steps_left runs out first."""
    engine.train()  # STEP
    loss_sum = torch.zeros((), device=device)
    steps = 0
    for batch in loader:
        if steps == steps_left:
            break
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        loss = nn.functional.cross_entropy(engine(**batch).logits.float(), labels)  # STEP: no autocast: the engine's forward turns it off
        engine.backward(loss)  # STEP: fp16 loss scaling; averages the gradients (stages 2-3: as backward makes each)
        engine.step()  # STEP: unscale, clip the whole gradient to --max-grad-norm, AdamW on this rank's shard, the schedule
        loss_sum += loss.detach()
        steps += 1
        progress.update()
    return loss_sum.item() / max(steps, 1), steps


@torch.no_grad()
def evaluate(model, loader, device, unpadded):  # STEP
    """Count correct predictions and pairs seen among this rank's first `unpadded` pairs."""
    model.eval()
    correct = seen = 0
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        predictions = model(**batch).logits.argmax(dim=-1)  # STEP
        keep = min(labels.numel(), unpadded - seen)
        correct += (predictions[:keep] == labels[:keep]).sum().item()
        seen += keep
    return correct, seen


def main(args):
    launch = require_launcher("src/ch4/sharded/nli_deepspeed.py")  # STEP
    device = device_for(launch)
    timeout = timedelta(seconds=args.dist_timeout)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    with exit_if_peers_missing(launch, args.dist_timeout):
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, device_id=device if device.type != "cpu" else None)
        dist.barrier(async_op=True).wait(timeout=timeout)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler)
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size,
                             DistributedSampler(eval_set, shuffle=False))
    unpadded = len(DistributedEvalSampler(eval_set))

    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    config = deepspeed_config(args, launch.world_size, precision, max_grad_norm=args.max_grad_norm)  # STEP
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,  # STEP
                                                   lr_scheduler=scheduler, config=config)  # STEP

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, "  # STEP
           f"ZeRO stage {engine.zero_optimization_stage()}, "  # STEP
           f"global batch {args.batch_size} = {launch.world_size} x {batch_size}")  # STEP
    progress = tqdm(total=total_steps, desc="training", disable=launch.rank != 0)
    steps_done, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss, steps = train_epoch(engine, train_loader, device, total_steps - steps_done, progress)  # STEP
        train_seconds += time.perf_counter() - start
        steps_done += steps
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()

    correct, seen = evaluate(engine, eval_loader, device, unpadded)  # STEP: stage 3: every rank runs every forward
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, {steps_done / train_seconds:.2f} steps/s, "
           f"{steps_done * args.batch_size / train_seconds:.1f} samples/s")
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    dist.destroy_process_group()
    exit_process()


if __name__ == "__main__":
    main(add_deepspeed_flags(nli_parser(__doc__)).parse_args())  # STEP
