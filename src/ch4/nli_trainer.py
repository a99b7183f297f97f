"""MultiNLI with BERT, by transformers' Trainer under torchrun: ddp.py with its loops handed to the Trainer.

The same model, data, global batch, AdamW, linear schedule, clipping and evaluation as ddp.py; what
ddp.py writes out, the Trainer does inside train() and evaluate() (docs/deepspeed.md has the table,
line by line): the process group and the device, the sampler that gives each rank its share, the
DDP wrap, autocast and the fp16 loss scaler, the clipping, the schedule, and the gathered metrics.
What changes from ddp.py:
  - TrainingArguments carries the settings; on a machine without a GPU it needs use_cpu=True (and
    gloo), or each of the N processes trains alone on the whole data;
  - the Trainer starts the process group itself (Accelerate, under torchrun's variables);
  - evaluate() pads the last batches so that every rank runs as many (Accelerate's even_batches),
    gathers the predictions and drops the padding (gather_for_metrics): every pair counted once;
  - --deepspeed CONFIG hands the Trainer a DeepSpeed ZeRO config ("auto" values filled from these
    settings: src/ch4/deepspeed_configs/zero3.json), and the Trainer trains with DeepSpeed's engine
    instead of DDP, on GPUs and on the CPU alike (DeepSpeed's CPU accelerator, gloo).

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    # 4 GPUs, global batch 32 = 4 x 8
    torchrun --nproc_per_node=4 src/ch4/nli_trainer.py
    # GPUs, ZeRO-3
    torchrun --nproc_per_node=4 src/ch4/nli_trainer.py --deepspeed src/ch4/deepspeed_configs/zero3.json
    # CPU: gloo
    torchrun --nproc_per_node=2 src/ch4/nli_trainer.py --model path/to/bert --dataset pairs.jsonl

It rewrites much of ddp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/ddp.py src/ch4/nli_trainer.py` shows the change.
"""
import numpy as np
import torch
import torch.distributed as dist
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

from common.cli import add_nli_trainer_flags, nli_parser, per_process_batch
from common.distributed import device_for, exit_process, print0, processes, require_launcher
from common.nli import load_model_and_tokenizer, load_pairs, tokenize_pairs
from common.precision import resolve_precision


def accuracy(prediction) -> dict:
    """Called by evaluate() on rank 0's gathered logits and labels, the padding already dropped."""
    correct = (np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).sum()
    return {"correct": int(correct), "seen": len(prediction.label_ids)}


def main(args):
    launch = require_launcher("src/ch4/nli_trainer.py")
    device = device_for(launch)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    train_set, eval_set = (tokenize_pairs(pairs, tokenizer, args.max_length)
                           for pairs in (train_pairs, eval_pairs))
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    training_args = TrainingArguments(  # what ddp.py's lines did, as settings
        output_dir=args.output_dir, report_to="none", save_strategy="no", logging_strategy="no",
        per_device_train_batch_size=batch_size, per_device_eval_batch_size=args.eval_batch_size,  # the sampler's share
        num_train_epochs=args.epochs, max_steps=args.max_steps or -1, max_grad_norm=args.max_grad_norm,
        seed=args.seed, bf16=precision == "bf16", fp16=precision == "fp16",  # autocast, and the scaler for fp16
        use_cpu=device.type == "cpu", ddp_backend="gloo" if device.type == "cpu" else None,  # else each process alone
        ddp_timeout=int(args.dist_timeout), ddp_find_unused_parameters=False, deepspeed=args.deepspeed,
        average_tokens_across_devices=False)  # True multiplies the loss by N for models whose loss is a mean (BERT's)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy,
                      optimizers=(optimizer, None))  # ddp.py's AdamW; the Trainer adds the linear schedule

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    result = trainer.train()  # process group, DDP wrap, sampler, autocast, clipping, schedule, steps
    print0(f"{result.global_step} steps, rank 0's mean training loss {result.training_loss:.4f}, "
           f"learning rate {trainer.lr_scheduler.get_last_lr()[0]:.3e}")
    if trainer.is_deepspeed_enabled:
        print0(f"trained by DeepSpeed's engine, ZeRO stage {trainer.model_wrapped.zero_optimization_stage()}")
    metrics = trainer.evaluate()  # every pair once, gathered to every rank
    print0(f"train time {result.metrics['train_runtime']:.1f} s, "
           f"{result.global_step / result.metrics['train_runtime']:.2f} steps/s, "
           f"{result.global_step * args.batch_size / result.metrics['train_runtime']:.1f} samples/s")
    print0(f"eval accuracy {metrics['eval_correct'] / metrics['eval_seen']:.2%} "
           f"over {metrics['eval_seen']} pairs")
    dist.destroy_process_group()
    exit_process()  # Accelerate's state holds the process group past its destruction, as FSDP2's does


if __name__ == "__main__":
    main(add_nli_trainer_flags(nli_parser(__doc__)).parse_args())  # --deepspeed, --output-dir
