"""What checkpointing costs: seconds per save, and its share of training time at the scripts' default interval.

For each model: the seconds of one training step (forward, backward, AdamW; the chapter's batch,
one process, this machine's --precision auto), the seconds of one save through common/checkpoint.py
(weights, AdamW's two moments, position, random state; temporary file, fsync, rename, fsync), and
share = save / (interval x step + save). The models are built from their configurations (random
weights cost the same to save as trained ones), so nothing is downloaded:

    python benchmarks/checkpoint_cost.py                                   # BasicNet, tiny BERT, MiniLM-L6, BERT-base
    python benchmarks/checkpoint_cost.py --models basicnet --repeats 2     # a quick look

The checkpoints go to a temporary folder under --dir (default: the system's), which should be on
the disk the real checkpoints go to. Prints a table; --plot saves the shares as a bar chart.
"""
import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from plotting import bar_chart

from common.checkpoint import Checkpoints, Position
from common.cli import positive_int
from common.distributed import device_for
from common.machine import machine_name
from common.mnist import BasicNet
from common.precision import autocast, resolve_precision

BERT_SHAPES = {  # name: hidden size, layers, heads, intermediate size
    "tiny BERT shape, cased vocab": (32, 2, 2, 64),
    "MiniLM-L6 shape, cased vocab": (384, 6, 12, 1536),
    "bert-base-cased": (768, 12, 12, 3072),
}
MODELS = {"basicnet": "BasicNet", "tiny": "tiny BERT shape, cased vocab", "minilm": "MiniLM-L6 shape, cased vocab", "bert-base": "bert-base-cased"}
INTERVAL = {"BasicNet": 200, "BERT": 500}  # --checkpoint-every in mnist_3_ddp_resume.py and ddp_resume.py


def model_and_batch(name: str):
    """The model and one training batch of the chapter's size: MNIST 64 images, MultiNLI 32 pairs of 128 tokens."""
    if name == "BasicNet":
        return BasicNet().to(memory_format=torch.channels_last), (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    from transformers import BertConfig, BertForSequenceClassification
    hidden, layers, heads, intermediate = BERT_SHAPES[name]
    config = BertConfig(vocab_size=28996, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, num_labels=3)
    return BertForSequenceClassification(config), (torch.randint(0, 28996, (32, 128)), torch.randint(0, 3, (32,)))


def synchronized_clock(device) -> float:
    """perf_counter after the GPU has finished what was queued, so that a time covers the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_seconds(model, batch, optimizer, device, precision, repeats: int) -> float:
    inputs, labels = (tensor.to(device) for tensor in batch)
    if inputs.dim() == 4:
        inputs = inputs.to(memory_format=torch.channels_last)

    def step():
        with autocast(device, precision):
            output = model(inputs)
            logits = output if isinstance(output, torch.Tensor) else output.logits
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    step()  # warm-up, and AdamW's moments exist from here on
    times = []
    for _ in range(repeats):
        start = synchronized_clock(device)
        step()
        times.append(synchronized_clock(device) - start)
    return statistics.median(times)


def save_seconds(model, optimizer, folder: str, repeats: int, device) -> tuple[float, int]:
    checkpoints = Checkpoints(folder, every=1, fingerprint={}, device=device)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    times = []
    for step in range(1, repeats + 1):
        start = synchronized_clock(device)
        checkpoints.save(Position(step=step), state)
        times.append(synchronized_clock(device) - start)
    size = max(checkpoints.folder.glob("step-*.pt")).stat().st_size
    return statistics.median(times), size


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed steps and saves per model (median)")
    parser.add_argument("--dir", help="where the temporary checkpoint folder goes (default: the system's temp folder)")
    parser.add_argument("--plot", help="save a bar chart of the shares here (PNG)")
    args = parser.parse_args()
    device = device_for()
    precision = resolve_precision("auto", device)
    print(f"{machine_name(device)}, {torch.get_num_threads()} threads, {precision}")
    print("| model | parameters | checkpoint MB | save s | step s | interval (steps) | share of training time |")
    print("|---|---|---|---|---|---|---|")
    shares, labels = {}, []
    for key in args.models:
        name = MODELS[key]
        torch.manual_seed(0)
        model, batch = model_and_batch(name)
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = step_seconds(model, batch, optimizer, device, precision, args.repeats)
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            save, size = save_seconds(model, optimizer, folder, args.repeats, device)
        interval = INTERVAL["BasicNet" if name == "BasicNet" else "BERT"]
        share = save / (interval * step + save)
        shares[name] = 100 * share
        labels.append(f"{100 * share:.2f} % ({save:.2f} s per save, every {interval} steps)")
        parameters = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {parameters / 1e6:.1f} M | {size / 1e6:.1f} | {save:.3f} | {step:.3f} | {interval} | "
              f"{100 * share:.2f} % |")
    if args.plot:
        bar_chart(shares, labels, "% of training time spent saving",
                  f"Synchronous checkpoints at the default interval, {machine_name(device)}", args.plot)


if __name__ == "__main__":
    main()
