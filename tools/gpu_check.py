"""Every GPU check in one command (`make gpu-check`): tests/test_gpu.py, then the GPU rows of the
benchmarks, written as Markdown tables, with the device and the software named, to docs/gpu_results.md.

    python tools/gpu_check.py --data-dir data      # MNIST/raw under data/; about 5 minutes on one H100

The rows: one MNIST epoch on one GPU for the reference loop (benchmarks/reference_mnist.py), for
mnist_1_single.py in fp32 and bf16, for mnist_3_ddp.py under torchrun with 1 process and for
mnist_4_accelerate.py under accelerate launch with 1 process; then the training throughput of a
BERT-base-sized classifier (BertConfig's defaults: 12 layers, hidden 768, random weights, nothing
downloaded) at global batch 128 and 128 tokens, in fp32, bf16 and fp16, after a warm-up, with the peak
GPU memory (torch.cuda.max_memory_allocated), each beside what common.plan predicts for it on the GPU's
preset (the plan's GPU row: benchmarks/plan_check.py checks it on CPU processes). Without a GPU it says
so in one sentence and exits 0.
MNIST must be on the GPU machine itself: where the repository is copied there (a working tree sent to
a lent machine), a folder beside it such as ../shared/data does not travel, so copy MNIST/raw into the
repository first (cp -r ../shared/data/MNIST data/, ignored by git) and carry that folder along.
"""
import argparse
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from common.machine import machine_name  # noqa: E402  (after the path above)
from common.plan import GB, GPU, GPUS, NETWORKS, model_of_config, plan, step_flops  # noqa: E402
from common.precision import autocast, grad_scaler, optimizer_step  # noqa: E402
from sharded_memory import state_tensors, storage_bytes  # noqa: E402

RESULTS = ROOT / "docs" / "gpu_results.md"
NO_GPU = "gpu-check: no CUDA GPU is visible on this machine, so there is nothing to check; run it where there is one."


def mnist_rows(data_dir: str) -> dict[str, dict]:
    """One epoch per run, each a fresh process started as a user starts it (mnist_speed.measure)."""
    from mnist_speed import measure
    python, ch4 = sys.executable, "src/ch4"
    data = ["--data-dir", data_dir]
    runs = {
        ("MNIST epoch: reference loop (per-sample transforms)", "fp32"): [python, "benchmarks/reference_mnist.py", *data],
        ("MNIST epoch: mnist_1_single.py", "fp32"): [python, f"{ch4}/mnist_1_single.py", *data, "--precision", "fp32"],
        ("MNIST epoch: mnist_1_single.py", "bf16"): [python, f"{ch4}/mnist_1_single.py", *data, "--precision", "bf16"],
        ("MNIST epoch: mnist_3_ddp.py, torchrun, 1 process", "bf16"):
            [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", f"{ch4}/mnist_3_ddp.py", *data,
             "--precision", "bf16"],
        ("MNIST epoch: mnist_4_accelerate.py, accelerate launch, 1 process", "fp16"):
            [python, "-m", "accelerate.commands.launch", "--config_file", f"{ch4}/accelerate_configs/multi_gpu_fp16.yaml",
             "--num_processes", "1", f"{ch4}/mnist_4_accelerate.py", *data],
    }
    rows = {}
    for name, command in runs.items():
        print(f"running: {' '.join(command)}", flush=True)
        rows[name] = measure(command)
    return rows


def bert_base_row(precision: str, device: torch.device, config=None, batch: int = 128, tokens: int = 128,
                  warmup: int = 3, steps: int = 10) -> dict:
    """Training samples/s of a BERT-base-sized classifier (config: BertConfig's defaults) on one device,
    the bytes of its model state (parameters, gradients, optimizer state), and on a GPU the peak memory
    of its steps; with the batch and tokens, for plan_beside."""
    from transformers import BertConfig, BertForSequenceClassification
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = BertForSequenceClassification(config or BertConfig(num_labels=3)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    scaler = grad_scaler(device, precision)
    ids = torch.randint(1000, model.config.vocab_size, (batch, tokens), device=device)
    labels = torch.randint(0, model.config.num_labels, (batch,), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        with autocast(device, precision):
            loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        optimizer_step(optimizer, scaler)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    params = list(model.parameters())
    row = {"samples_per_s": steps * batch / seconds, "batch": batch, "tokens": tokens,
           "state_bytes": storage_bytes([*params, *(p.grad for p in params), *state_tensors(optimizer)]),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return row


def gpu_preset(name: str) -> GPU | None:
    """common.plan's preset for a device name such as 'NVIDIA H100 80GB HBM3'; None if there is none (the
    presets are the SXM parts: an H100 PCIe or NVL has a lower peak)."""
    if re.search(r"PCIe|NVL", name, re.IGNORECASE):
        return None
    return next((gpu for key, gpu in GPUS.items() if re.search(rf"\b{key}\b", name, re.IGNORECASE)), None)


def plan_beside(measured: dict, precision: str, gpu: GPU, config=None) -> dict:
    """common.plan's prediction for the run bert_base_row measured: one GPU (no communication) at the
    calculator's default MFU; and the MFU the run reached, from the same FLOP count.

    Autocast keeps fp32 weights and gradients (4 + 4 + 8 bytes per parameter), where the plan's mixed
    precision counts 2 + 2 + 12: the same 16, split otherwise, so the model state is compared in total."""
    from transformers import AutoModelForSequenceClassification, BertConfig
    shape = model_of_config(config or BertConfig(num_labels=3), AutoModelForSequenceClassification)
    kind = "fp32" if precision == "fp32" else "mixed"
    batch, tokens = measured["batch"], measured["tokens"]
    predicted = plan("ddp", shape, 1, 1, gpu, NETWORKS["nvlink"], NETWORKS["nvlink"], kind, batch, tokens)
    peak = gpu.flops_fp32 if kind == "fp32" else gpu.flops_16bit
    step_s = batch / measured["samples_per_s"]
    return {"samples_per_s": predicted.samples_per_s, "mfu": step_flops(shape, batch * tokens, tokens) / (step_s * peak),
            "state_bytes": predicted.params_bytes + predicted.grads_bytes + predicted.optimizer_bytes,
            "total_bytes": predicted.total_bytes}


def software() -> str:
    import accelerate
    import lightning
    import transformers
    return (f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, lightning {lightning.__version__}")


def bert_table(bert: dict, device: str) -> list[str]:
    """The BERT-base rows, each beside common.plan's prediction for the same run on this GPU's preset."""
    gpu = gpu_preset(device)
    lines = ["BERT-base-sized fine-tuning on 1 GPU: BertConfig's default sizes with random weights, batch 128 of 128",
             "tokens, throughput after 3 warm-up steps. Measured, and in brackets what `python -m common.plan`",
             "predicts for it " + (f"with the {gpu.name} preset at its default MFU of 0.4; the MFU column is the "
                                   "share of the preset's peak the run reached. Model state: parameters, gradients "
                                   "and AdamW's state as held (autocast keeps fp32 weights and gradients: 16 bytes "
                                   "per parameter, as the plan's mixed precision, split otherwise); peak: "
                                   "`torch.cuda.max_memory_allocated`, against the plan's state + activations."
                                   if gpu else f"(no preset in common.plan matches {device}: {', '.join(GPUS)})."),
             "", "| precision | samples/s | MFU | model state GB | peak GB |", "|---|---:|---:|---:|---:|"]
    for precision, r in bert.items():
        p = plan_beside(r, precision, gpu) if gpu else None
        cells = [f"{r['samples_per_s']:.0f}" + (f" ({p['samples_per_s']:.0f})" if p else ""),
                 f"{p['mfu']:.2f}" if p else "",
                 f"{r['state_bytes'] / GB:.2f}" + (f" ({p['state_bytes'] / GB:.2f})" if p else ""),
                 f"{r['peak_bytes'] / GB:.1f}" + (f" ({p['total_bytes'] / GB:.1f})" if p else "")]
        lines.append(f"| {precision} | {' | '.join(cells)} |")
    return lines


RESULTS_START, RESULTS_END = "<!-- gpu-check results -->", "<!-- end gpu-check results -->"


def results(tests: str, mnist: dict, bert: dict, device: str, seconds: float) -> str:
    lines = ["## Results", "",
             "Written by `make gpu-check` ([`tools/gpu_check.py`](../tools/gpu_check.py)). GB = 10^9 bytes.", "",
             f"Device: {device}, one GPU. Software: {software()}.", "",
             f"`tests/test_gpu.py`: {tests}", "",
             "MNIST: one training epoch (evaluation and start-up not counted), global batch 64.", "",
             "| run | precision | train s | samples/s | test accuracy |", "|---|---|---:|---:|---:|"]
    for (name, precision), r in mnist.items():
        lines.append(f"| {name} | {precision} | {r['seconds']:.1f} | {r['samples_per_s']:.0f} | {r['accuracy']:.2f}% |")
    lines += ["", *bert_table(bert, device), "", f"The whole check took {seconds / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"


def write_results(path: Path, section: str) -> None:
    """Into the page between its two markers, so that the page's own text stays; a file without them gets the
    section alone."""
    text = path.read_text() if path.is_file() else ""
    if RESULTS_START in text and RESULTS_END in text:
        before, rest = text.split(RESULTS_START, 1)
        section = f"{before}{RESULTS_START}\n{section}{RESULTS_END}{rest.split(RESULTS_END, 1)[1]}"
    path.write_text(section)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data", help="folder holding MNIST/raw, on this machine (default: data)")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"the page to write (default: {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(NO_GPU)
        return
    start = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-n0", "-q", "tests/test_gpu.py"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    print(f"tests/test_gpu.py: {summary}", flush=True)
    mnist = mnist_rows(args.data_dir)
    bert = {precision: bert_base_row(precision, torch.device("cuda")) for precision in ("fp32", "bf16", "fp16")}
    write_results(args.output, results(summary, mnist, bert, machine_name(torch.device("cuda", 0)), time.perf_counter() - start))
    print(args.output.read_text())
    if tests.returncode:
        sys.exit(f"error: tests/test_gpu.py failed:\n{tests.stdout[-3000:]}")


if __name__ == "__main__":
    main()
