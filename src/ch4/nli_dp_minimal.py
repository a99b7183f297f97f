"""MultiNLI with BERT, minimal DataParallel: the fewest lines that fine-tune on several GPUs.

Raw premise/hypothesis pairs are tokenized batch by batch inside the DataLoader, the model is
wrapped in nn.DataParallel (every visible GPU; on a CPU it just runs the model), and Adam at 3e-5
trains for --max-steps steps (default 300), printing the loss every 10 steps. The accuracy over the
evaluation pairs is printed at the end. data_parallel.py is the full version.

Run from the repository root (the defaults download bert-base-cased and MultiNLI from the hub):
    python src/ch4/nli_dp_minimal.py
    python src/ch4/nli_dp_minimal.py --model path/to/bert --dataset pairs.jsonl --max-steps 50

nli_ddp_minimal.py changes this script into DDP: lines marked `# STEP` there.
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from common.cli import nli_parser
from common.distributed import device_for, print0
from common.nli import PairCollator, load_model_and_tokenizer, load_pairs, to_device


def main(args):
    device = device_for()
    torch.manual_seed(args.seed)

    model, tokenizer = load_model_and_tokenizer(args.model)
    train_pairs, eval_pairs = load_pairs(args.dataset, args.eval_split, args.max_train_samples,
                                         args.max_eval_samples)
    collate = PairCollator(tokenizer, args.max_length)
    batch_size = args.batch_size
    train_sampler = RandomSampler(train_pairs)
    train_loader = DataLoader(train_pairs, batch_size=batch_size, sampler=train_sampler, collate_fn=collate)
    eval_loader = DataLoader(eval_pairs, batch_size=args.eval_batch_size,
                             sampler=SequentialSampler(eval_pairs), collate_fn=collate)

    model = model.to(device)
    model = nn.DataParallel(model)  # split each batch over all visible GPUs
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    print0(f"one process, DataParallel over {torch.cuda.device_count()} GPU(s), "
           f"global batch {args.batch_size}")
    model.train()
    step, epoch = 0, 0
    while step < args.max_steps:
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
                print0(f"step {step}: loss {loss.item():.4f}")
            if step == args.max_steps:
                break
        epoch += 1

    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for batch in eval_loader:
            batch = to_device(batch, device)
            labels = batch.pop("labels")
            correct += (model(**batch).logits.argmax(dim=-1) == labels).sum().item()
            seen += labels.numel()
    print0(f"eval accuracy {correct / seen:.2%} over {seen} pairs")


if __name__ == "__main__":
    parser = nli_parser(__doc__, precision=False, lr=3e-5, max_steps=300)  # fp32 only: data_parallel.py shows mixed precision
    main(parser.parse_args())
