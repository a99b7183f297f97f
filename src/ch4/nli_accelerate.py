"""MultiNLI with BERT, the DDP fine-tuning of ddp.py with HuggingFace Accelerate doing the plumbing.

accelerator.prepare() picks the device, wraps the model in DDP, shards the data loaders and moves
batches to the device; accelerator.backward() replaces loss.backward() (with loss scaling for fp16);
mixed precision comes from the launch config where it names fp16 or bf16 (else --precision); and
gather_for_metrics() collects predictions from every rank and drops the pairs repeated to give all
ranks equal batches, so the accuracy is over exactly the evaluation set. The training runs in
training_function(args), which Accelerate's notebook_launcher can start from a notebook:
    from accelerate import notebook_launcher
    from common.cli import nli_parser
    notebook_launcher(training_function, (nli_parser("").parse_args([...]),), num_processes=2)

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    NGPU=$(python -c 'import torch; print(torch.cuda.device_count())')           # every GPU, fp16
    accelerate launch --config_file src/ch4/accelerate_configs/multi_gpu_fp16.yaml --num_processes $NGPU \\
        src/ch4/nli_accelerate.py
    accelerate launch --config_file src/ch4/accelerate_configs/cpu_2_processes.yaml \\
        src/ch4/nli_accelerate.py \
        --model path/to/bert --dataset pairs.jsonl
The CPU trap of mnist_4_accelerate.py applies: --cpu --num_processes 2 starts ONE process.

It rewrites much of ddp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/ddp.py src/ch4/nli_accelerate.py` shows the change.
"""
import os
import sys
import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import RandomSampler, SequentialSampler
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.cli import nli_parser, per_process_batch
from common.distributed import detect_launch, device_for, print0, processes
from common.gather import sum_across_ranks
from common.nli import load_model_and_tokenizer, load_pairs, nli_loader, to_device, tokenize_pairs
from common.precision import accelerate_mixed_precision


def train_epoch(model, loader, optimizer, scheduler, accelerator, device, max_grad_norm,
                steps_left, progress):
    """One pass over this process's share of the pairs, or fewer if steps_left runs out first."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    steps = 0
    for batch in loader:
        if steps == steps_left:
            break
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        loss = nn.functional.cross_entropy(model(**batch).logits, labels)  # prepare() put autocast in forward
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)  # scales the loss for fp16, then runs backward
        accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)  # unscales fp16 gradients first
        optimizer.step()
        scheduler.step()  # prepare()d, it skips the steps that fp16 loss scaling skipped
        loss_sum += loss.detach()
        steps += 1
        progress.update()
    return loss_sum.item() / max(steps, 1), steps


@torch.no_grad()
def evaluate(model, loader, accelerator, device):
    """Count correct predictions and pairs seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        predictions = model(**batch).logits.argmax(dim=-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, labels))  # all ranks, repeats dropped
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def training_function(args):  # what notebook_launcher runs in each process
    # cpu=True without GPUs, or N launched processes would each train alone instead of forming a gloo group
    # device_for stops with one sentence if this node has more processes than GPUs
    accelerator = Accelerator(cpu=device_for(detect_launch()).type == "cpu",
                              mixed_precision=accelerate_mixed_precision(args.precision))
    device = accelerator.device
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and accelerator.state.deepspeed_plugin is None:  # cpu=True drops it
        sys.exit("error: this Accelerate config asks for DeepSpeed, "
                 "which Accelerate runs on GPUs only (on the CPU it would "
                 "train plain DDP without a word): "
                 "run src/ch4/sharded/nli_deepspeed.py for DeepSpeed on the CPU.")
    if device.type == "cpu" and accelerator.num_processes > 1:  # as torchrun's OMP_NUM_THREADS=1, and a must when
        torch.set_num_threads(1)  # notebook_launcher forks a kernel whose OpenMP threads the child lacks (it would hang)
    # every rank builds the same classifier head: under DDP prepare() would copy rank 0's weights to all,
    # but under FSDP2 (fsdp2_gpus.yaml) it shards each rank's own and broadcasts nothing
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model)
    torch.manual_seed(args.seed + accelerator.process_index)  # then each rank its own dropout masks

    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = per_process_batch(args.batch_size, accelerator.num_processes)
    train_sampler = RandomSampler(train_set)  # prepare() deals the batches out to the ranks
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler)
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size, SequentialSampler(eval_set))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader,  # before len(train_loader), which it shards
                                                                      eval_loader)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    # a prepare()d scheduler advances num_processes times per step (once per process's batch), so its
    # length counts every process's steps; it also skips the steps that fp16 loss scaling skipped
    scheduler = accelerator.prepare(get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=0, num_training_steps=total_steps * accelerator.num_processes))

    print0(f"{processes(accelerator.num_processes)} on {device.type}, {accelerator.mixed_precision}, "
           f"global batch {args.batch_size} = {accelerator.num_processes} x {batch_size}")
    progress = tqdm(total=total_steps, desc="training", disable=not accelerator.is_main_process)
    steps_done, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loss, steps = train_epoch(model, train_loader, optimizer, scheduler, accelerator, device,
                                  args.max_grad_norm, total_steps - steps_done, progress)
        train_seconds += time.perf_counter() - start
        steps_done += steps
        loss = sum_across_ranks(loss, device=device)[0] / accelerator.num_processes
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()

    correct, seen = evaluate(model, eval_loader, accelerator, device)
    print0(f"train time {train_seconds:.1f} s, {steps_done / train_seconds:.2f} steps/s, "
           f"{steps_done * args.batch_size / train_seconds:.1f} samples/s")
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")
    accelerator.end_training()


if __name__ == "__main__":
    training_function(nli_parser(__doc__).parse_args())
