"""MultiNLI with BERT, full DataParallel version: the datasets pipeline, a schedule, tqdm, evaluation.

Fine-tunes a BERT sequence classifier (3 labels: entailment, neutral, contradiction) on MultiNLI
premise/hypothesis pairs. The data path is the one HuggingFace examples use: `datasets` loads the
pairs, `map` tokenizes them once, DataCollatorWithPadding pads each batch to its own longest pair.
AdamW 5e-5 with a linear decay, a tqdm bar, and the accuracy over the whole evaluation set at the end.
nn.DataParallel splits each batch over all visible GPUs (on a CPU it just runs the model).

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    python src/ch4/data_parallel.py
    python src/ch4/data_parallel.py --eval-split validation_matched --batch-size 128
    python src/ch4/data_parallel.py --model path/to/bert --dataset pairs.jsonl --max-train-samples 2000
Offline, pass --model and --dataset with local copies.

This script is the base that ddp.py and nli_loss_in_forward.py change: lines marked `# STEP` there.
"""
import time

import torch
import torch.nn as nn
from torch.utils.data import RandomSampler, SequentialSampler
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from common.cli import add_compile_flag, nli_parser
from common.compile import compiled
from common.distributed import device_for, print0
from common.nli import load_model_and_tokenizer, load_pairs, nli_loader, to_device, tokenize_pairs
from common.precision import Autocast, autocast, grad_scaler, optimizer_step, resolve_precision


def train_epoch(model, loader, optimizer, scheduler, scaler, device, precision, max_grad_norm,
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
        with autocast(device, precision):
            loss = nn.functional.cross_entropy(model(**batch).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # fp16: the true gradients, so that the norm is measured on them
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # the total norm of the whole averaged gradient
        if optimizer_step(optimizer, scaler):  # False where fp16 loss scaling skipped the step
            scheduler.step()
        loss_sum += loss.detach()
        steps += 1
        progress.update()
    return loss_sum.item() / max(steps, 1), steps


@torch.no_grad()
def evaluate(model, loader, device, precision):
    """Count correct predictions and pairs seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for batch in loader:
        batch = to_device(batch, device)
        labels = batch.pop("labels")
        with autocast(device, precision):
            predictions = model(**batch).logits.argmax(dim=-1)
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main(args):
    device = device_for()
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = args.batch_size
    train_sampler = RandomSampler(train_set)
    train_loader = nli_loader(train_set, tokenizer, batch_size, train_sampler)
    eval_loader = nli_loader(eval_set, tokenizer, args.eval_batch_size, SequentialSampler(eval_set))

    model = model.to(device)
    model = nn.DataParallel(Autocast(model, device, precision))  # every visible GPU; autocast inside each replica's thread
    model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = min(args.max_steps or float("inf"), args.epochs * len(train_loader))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=total_steps)
    scaler = grad_scaler(device, precision)

    print0(f"one process, DataParallel over {torch.cuda.device_count()} GPU(s), {precision}, "
           f"global batch {args.batch_size}")
    progress = tqdm(total=total_steps, desc="training")
    steps_done, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loss, steps = train_epoch(model, train_loader, optimizer, scheduler, scaler, device, precision,
                                  args.max_grad_norm, total_steps - steps_done, progress)
        train_seconds += time.perf_counter() - start
        steps_done += steps
        print0(f"epoch {epoch}: mean training loss {loss:.4f}, "
               f"learning rate {scheduler.get_last_lr()[0]:.3e}")
    progress.close()

    correct, seen = evaluate(model, eval_loader, device, precision)
    print0(f"train time {train_seconds:.1f} s, {steps_done / train_seconds:.2f} steps/s, "
           f"{steps_done * args.batch_size / train_seconds:.1f} samples/s")
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")


if __name__ == "__main__":
    main(add_compile_flag(nli_parser(__doc__)).parse_args())
