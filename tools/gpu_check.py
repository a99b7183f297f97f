"""Every GPU check in one command (`make gpu-check`): tests/test_gpu.py, then the GPU rows of the
benchmarks, written as Markdown tables, with the device and the software named, to docs/gpu_results.md.

    python tools/gpu_check.py --data-dir data      # MNIST/raw under data/; 4.8 minutes on one H200
    python tools/gpu_check.py --cpu --data-dir D --output page.md   # every row's code path on the CPU, at toy size

The rows: one MNIST epoch on one GPU for the original loop (benchmarks/reference_mnist.py), for
mnist_1_single.py in fp32 and bf16, for mnist_3_ddp.py under torchrun with 1 process and for
mnist_4_accelerate.py under accelerate launch with 1 process; then the training throughput of a
BERT-base-sized classifier (BertConfig's defaults: 12 layers, hidden 768, random weights, nothing
downloaded) at global batch 128 and 128 tokens, in fp32, bf16 and fp16, after a warm-up, with the peak
GPU memory (torch.cuda.max_memory_allocated), each beside what planner.plan predicts for it on the GPU's
preset (the plan's GPU row: benchmarks/plan_check.py checks it on CPU processes); last, whether the
input pipeline keeps up with one GPU: benchmarks/loader_speed.py's table at 1 rank for 0 to 4 DataLoader
workers, with and without pin_memory.

A row that fails is written as failed, with its one-line reason, and the others still run; the page is
always written, and the command then exits non-zero. Without a GPU it says so in one sentence and exits 0;
it exits non-zero with one sentence where nvidia-smi lists GPUs that torch does not see (unless
CUDA_VISIBLE_DEVICES is set to the empty string on purpose), and where every test of tests/test_gpu.py skipped.

--cpu runs the same rows on the CPU in the test suite (tests/test_gpu_paths.py): the MNIST scripts as real
processes on whatever MNIST --data-dir holds (a tiny one there), two at a time, the BERT rows on a toy
BertConfig, and no tests/test_gpu.py (the suite runs it itself). A row in a precision the CPU refuses (fp16) or only
emulates (bf16 without bf16 units, several times slower than fp32) runs in the CPU's --precision auto (bf16 with bf16
units, else fp32), and the page says so.

MNIST must be on the GPU machine itself: where the repository is copied there (a working tree sent to
a lent machine), a folder beside it such as ../shared/data does not travel, so copy MNIST/raw into the
repository first (cp -r ../shared/data/MNIST data/, ignored by git) and carry that folder along. On a
machine with no package index: `make gpu-check-offline` (tools/gpu_offline.py).
"""
import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from common.distributed import free_port  # noqa: E402  (after the path above)
from common.machine import machine_name  # noqa: E402
from common.memory import optimizer_tensors, storage_bytes  # noqa: E402
from common.precision import FP16_DEVICES, auto_precision, autocast, grad_scaler, optimizer_step  # noqa: E402
from planner.plan import GB, GPU, GPUS, NETWORKS, model_of_config, plan, step_flops  # noqa: E402

RESULTS = ROOT / "docs" / "gpu_results.md"
NO_GPU = "gpu-check: no CUDA GPU is visible on this machine, so there is nothing to check; run it where there is one."
PYTEST_TIMEOUT = 900  # seconds for the whole of tests/test_gpu.py
PYTEST_WORKERS = min(8, os.cpu_count() or 1)  # its tests share the GPUs: each is a small run, some compile for minutes
# --cpu: the BERT rows' code on a BertConfig this small (tests/test_gpu_paths.py uses the same), 2 x 8 tokens.
TOY_BERT = {"vocab_size": 1100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64}
TOY_STEPS = {"batch": 2, "tokens": 8, "warmup": 1, "steps": 1}
FAILED = (Exception, SystemExit)  # what one row may raise without stopping the others (not KeyboardInterrupt)


def on_device(precision: str, device: torch.device, has_bf16: bool | None = None) -> str:
    """The precision a row runs in: its own, except fp16 where common.precision refuses it and bf16 on a CPU, which
    without bf16 units only emulates it: there the device's --precision auto (on a CPU bf16 with bf16 units, else
    fp32; has_bf16 defaults to this CPU's)."""
    refused = precision == "fp16" and device.type not in FP16_DEVICES
    emulated = precision == "bf16" and device.type == "cpu"
    return auto_precision(device, has_bf16=has_bf16) if refused or emulated else precision


def one_line(error: BaseException, width: int = 240) -> str:
    """A failed row's reason, for a table cell: measure's sys.exit message ends with the end of the run's stderr,
    whose last line names the error; any other exception by its type and first line."""
    if isinstance(error, subprocess.TimeoutExpired):
        text = f"did not finish within {error.timeout:.0f} s"
    elif isinstance(error, SystemExit):
        lines = [line.strip() for line in str(error.code).splitlines() if line.strip()]
        text = lines[-1] if lines else f"exit status {error.code}"
    else:
        text = (f"{type(error).__name__}: {error}".splitlines() or [type(error).__name__])[0]
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1] + "…"


def run_env(environ, cache: str) -> dict[str, str]:
    """The environment of every process the check starts: mnist_speed's (a fresh inductor cache), with the
    repository on PYTHONPATH, so that the scripts import common where the project is not installed."""
    path = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p)
    return {**environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}


def mnist_runs(data_dir: str, device: torch.device, has_bf16: bool | None = None) -> dict[tuple[str, str], tuple[list[str], str]]:
    """Each row, (name, precision) -> (the command a user types, the precision it runs in on this device: on_device's).
    accelerate launch gets a free port (two checks at once would both take 29500) and, where the device refuses
    the config's fp16, the device's precision (its --mixed_precision overrides the config's)."""
    python, ch4 = sys.executable, "src/ch4"
    data = ["--data-dir", str(data_dir)]
    accelerate, bf16 = on_device("fp16", device, has_bf16), on_device("bf16", device, has_bf16)
    override = [] if accelerate == "fp16" else ["--mixed_precision", {"fp32": "no"}.get(accelerate, accelerate)]
    return {
        ("MNIST epoch: original loop (per-sample transforms)", "fp32"): ([python, "benchmarks/reference_mnist.py", *data], "fp32"),
        ("MNIST epoch: mnist_1_single.py", "fp32"):
            ([python, f"{ch4}/mnist_1_single.py", *data, "--epochs", "1", "--precision", "fp32"], "fp32"),
        ("MNIST epoch: mnist_1_single.py", "bf16"):
            ([python, f"{ch4}/mnist_1_single.py", *data, "--epochs", "1", "--precision", bf16], bf16),
        ("MNIST epoch: mnist_3_ddp.py, torchrun, 1 process", "bf16"):
            ([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", f"{ch4}/mnist_3_ddp.py", *data,
              "--epochs", "1", "--precision", bf16], bf16),
        ("MNIST epoch: mnist_4_accelerate.py, accelerate launch, 1 process", "fp16"):
            ([python, "-m", "accelerate.commands.launch", "--config_file", f"{ch4}/accelerate_configs/multi_gpu_fp16.yaml",
              "--num_processes", "1", "--main_process_port", str(free_port()), *override, f"{ch4}/mnist_4_accelerate.py",
              *data, "--epochs", "1"], accelerate),
    }


def mnist_rows(data_dir: str, device: torch.device = torch.device("cuda"), jobs: int = 1) -> dict[tuple[str, str], dict]:
    """One epoch per run, each a fresh process started as a user starts it (mnist_speed.measure, in mnist_speed's
    environment); a run that fails is a row with its reason ("failed"), and the others still run. jobs > 1 runs that
    many at once, for --cpu, whose times are no measurement; on a GPU the rows are timed one at a time."""
    from mnist_speed import measure

    def row(command: list[str], ran_as: str, env: dict[str, str]) -> dict:
        print(f"running: {' '.join(command)}", flush=True)
        try:
            return {**measure(command, env), "ran_as": ran_as}
        except FAILED as error:
            print(f"  failed: {one_line(error)}", flush=True)
            return {"failed": one_line(error), "ran_as": ran_as}

    runs = mnist_runs(data_dir, device)
    with tempfile.TemporaryDirectory() as cache:
        env = run_env(os.environ, cache)  # as mnist_speed.main: one inductor cache for the runs, fresh at the first
        if jobs == 1:
            return {name: row(command, ran_as, env) for name, (command, ran_as) in runs.items()}
        with ThreadPoolExecutor(jobs) as pool:
            started = {name: pool.submit(row, command, ran_as, env) for name, (command, ran_as) in runs.items()}
            return {name: future.result() for name, future in started.items()}


def bert_rows(device: torch.device, toy: bool = False) -> dict[str, dict]:
    """The three BERT-base rows (toy: the same code on TOY_BERT), each failing alone (out of memory, say)."""
    from transformers import BertConfig
    config, sizes = (BertConfig(**TOY_BERT, num_labels=3), TOY_STEPS) if toy else (None, {})
    rows = {}
    for precision in ("fp32", "bf16", "fp16"):
        ran_as = on_device(precision, device)
        print(f"BERT-base row: {precision}" + (f" (runs in {ran_as})" if ran_as != precision else ""), flush=True)
        try:
            rows[precision] = {**bert_base_row(ran_as, device, config, **sizes), "ran_as": ran_as}
        except FAILED as error:
            rows[precision] = {"failed": one_line(error), "ran_as": ran_as}
            print(f"  failed: {rows[precision]['failed']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def loader_rows(data_dir: str, toy: bool = False) -> dict:
    """benchmarks/loader_speed.py at 1 rank, as a user runs it: its table's lines, or why it failed."""
    command = [sys.executable, "benchmarks/loader_speed.py", "--data-dir", str(data_dir), "--ranks", "1",
               *(["--workers", "1", "--steps", "2"] if toy else ["--workers", "0", "1", "2", "4"])]
    print(f"running: {' '.join(command)}", flush=True)
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    except FAILED as error:
        return {"failed": one_line(error)}
    if result.returncode:
        return {"failed": one_line(RuntimeError((result.stderr.strip().splitlines() or ["no output"])[-1]))}
    return {"lines": [line for line in result.stdout.splitlines() if line.startswith("|")]}


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
           "state_bytes": storage_bytes([*params, *(p.grad for p in params), *optimizer_tensors(optimizer)]),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return row


def gpu_preset(name: str) -> GPU | None:
    """planner.plan's preset for a device name such as 'NVIDIA H100 80GB HBM3'; None if there is none (the
    presets are the SXM parts: an H100 PCIe or NVL has a lower peak)."""
    if re.search(r"PCIe|NVL", name, re.IGNORECASE):
        return None
    return next((gpu for key, gpu in GPUS.items() if re.search(rf"\b{key}\b", name, re.IGNORECASE)), None)


def plan_beside(measured: dict, precision: str, gpu: GPU, config=None) -> dict:
    """planner.plan's prediction for the run bert_base_row measured: one GPU (no communication) at the
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
            "state_bytes": predicted.param_bytes + predicted.grad_bytes + predicted.optimizer_bytes,
            "total_bytes": predicted.total_bytes}


def software() -> str:
    import accelerate
    import lightning
    import transformers
    return (f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, lightning {lightning.__version__}")

# ---- when the check must not pass quietly ----

def listed_gpus(listing: str | None) -> int:
    """The GPUs in `nvidia-smi -L`'s output ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)"; MIG lines are indented)."""
    return len(re.findall(r"^GPU \d+:", listing or "", re.MULTILINE))


def nvidia_smi_listing() -> str | None:
    """`nvidia-smi -L`'s output; None where there is no nvidia-smi, or it fails (no driver loaded)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def gpu_decision(listing: str | None, environ, torch_count: int, torch_version: str = torch.__version__,
                 torch_cuda: str | None = torch.version.cuda) -> tuple[int, str] | None:
    """None where torch sees a GPU (the check runs); else the exit status and the one sentence to stop with:
    0 and NO_GPU where there is none, or where CUDA_VISIBLE_DEVICES is set empty on purpose (the CPU suite does);
    1 where nvidia-smi lists GPUs that torch does not see, which is no result to record as 'no GPU'."""
    if torch_count:
        return None
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    listed = listed_gpus(listing)
    if hidden == "" or not listed:
        return 0, NO_GPU
    build = f"built for CUDA {torch_cuda}" if torch_cuda else "built without CUDA"
    why = (f"CUDA_VISIBLE_DEVICES={hidden} names none of them, or " if hidden is not None else "") + \
          "this torch needs a newer driver than the one nvidia-smi reports"
    return 1, (f"error: nvidia-smi lists {listed} GPU(s) but torch {torch_version} ({build}) sees none: {why}; "
               f"install a torch built for this driver, or set CUDA_VISIBLE_DEVICES= (empty) to check nothing on purpose.")


def gpu_tests_env(environ, torch_count: int, cache: str) -> dict[str, str]:
    """tests/test_gpu.py's environment: the GPUs torch sees named in CUDA_VISIBLE_DEVICES where it is unset, so
    that the tests take the GPUs from it (tests/conftest.py) and not from whether nvidia-smi is on the PATH."""
    env = {key: value for key, value in run_env(environ, cache).items() if key != "CPU_SUITE_SESSION_CUDA_VISIBLE_DEVICES"}
    env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(index) for index in range(torch_count)))
    return env


def summary_counts(summary: str) -> dict[str, int]:
    """pytest's summary line ("3 passed, 11 skipped in 12.3s") as counts; errors spelled "error" or "errors"."""
    return {word.rstrip("s") if word.startswith("error") else word: int(number)
            for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", summary)}


def tests_problem(summary: str, returncode: int) -> str | None:
    """One sentence where tests/test_gpu.py did not check the GPU: every test skipped (they saw no GPU), none
    ran, or some failed; None where they ran and passed."""
    counts = summary_counts(summary)
    ran = sum(counts.get(word, 0) for word in ("passed", "failed", "error", "xfailed", "xpassed"))
    if not ran and counts.get("skipped"):
        return (f"every test of tests/test_gpu.py skipped ({summary}), so nothing was checked on the GPU: "
                f"`python -m pytest -n0 -rs tests/test_gpu.py` says why.")
    if not ran:
        return f"no test of tests/test_gpu.py ran ({summary})."
    if returncode:
        return f"tests/test_gpu.py failed ({summary})."
    return None


def run_gpu_tests(env: dict[str, str], timeout: int = PYTEST_TIMEOUT) -> tuple[str, str | None, str]:
    """tests/test_gpu.py on this machine's GPUs: its summary line for the page, the sentence to exit with (None
    where it passed) and the end of its output. A run past the timeout is one line, not a traceback."""
    command = [sys.executable, "-m", "pytest", f"-n{PYTEST_WORKERS}", "--dist=load", "-q", "-rsfE", "-p", "no:benchmark",
               "tests/test_gpu.py"]  # skips, then failures: the end of the output names what failed
    try:
        tests = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        line = f"did not finish within {timeout} s (stopped)"
        return line, f"tests/test_gpu.py {line}.", output[-3000:]
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    return summary, tests_problem(summary, tests.returncode), (tests.stdout + tests.stderr)[-3000:]


def precision_cell(precision: str, ran_as: str) -> str:
    if ran_as == precision:
        return precision
    why = "the CPU has no fp16" if precision == "fp16" else "the CPU has no bf16 units"
    return f"{precision}, ran in {ran_as} ({why})"


def bert_table(bert: dict, device: str, toy: bool = False) -> list[str]:
    """The BERT-base rows, each beside planner.plan's prediction for the same run on this GPU's preset; toy (--cpu):
    the rows' code on TOY_BERT, with no prediction."""
    gpu = None if toy else gpu_preset(device)
    if toy:
        lines = [f"BERT rows at toy size on the CPU (`--cpu`): BertConfig with {TOY_BERT['num_hidden_layers']} layers, "
                 f"hidden size {TOY_BERT['hidden_size']}, batch {TOY_STEPS['batch']} of {TOY_STEPS['tokens']} tokens; "
                 "the code path of the GPU rows, not a measurement."]
    else:
        lines = ["BERT-base-sized fine-tuning on 1 GPU: BertConfig's default sizes with random weights, batch 128 of 128",
                 "tokens, throughput after 3 warm-up steps. Measured, and in brackets what `python -m planner.plan`",
                 "predicts for it " + (f"with the {gpu.name} preset at its default MFU of 0.4; the MFU column is the "
                                       "share of the preset's peak the run reached. Model state: parameters, gradients "
                                       "and AdamW's state as held (autocast keeps fp32 weights and gradients: 16 bytes "
                                       "per parameter, as the plan's mixed precision, split otherwise); peak: "
                                       "`torch.cuda.max_memory_allocated`, against the plan's state + activations."
                                       if gpu else f"(no preset in planner.plan matches {device}: {', '.join(GPUS)}).")]
    lines += ["", "| precision | samples/s | MFU | model state GB | peak GB |", "|---|---:|---:|---:|---:|"]
    for precision, r in bert.items():
        name = precision_cell(precision, r.get("ran_as", precision))
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed']} | | | |")
            continue
        p = plan_beside(r, r.get("ran_as", precision), gpu) if gpu else None
        peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / GB:.1f}"
        cells = [f"{r['samples_per_s']:.0f}" + (f" ({p['samples_per_s']:.0f})" if p else ""),
                 f"{p['mfu']:.2f}" if p else "",
                 f"{r['state_bytes'] / GB:.2f}" + (f" ({p['state_bytes'] / GB:.2f})" if p else ""),
                 peak + (f" ({p['total_bytes'] / GB:.1f})" if p else "")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


RESULTS_START, RESULTS_END = "<!-- gpu-check results -->", "<!-- end gpu-check results -->"


def results(tests: str, mnist: dict, bert: dict, device: str, seconds: float, cpu: bool = False,
            loader: dict | None = None) -> str:
    where = (f"Device: {device}, the CPU (`--cpu`: every row's code path at toy size; a check, not a measurement)."
             if cpu else f"Device: {device}, one GPU.")
    lines = ["## Results", "",
             "Written by [`tools/gpu_check.py`](../tools/gpu_check.py) (`make gpu-check` or `make gpu-check-offline`). "
             "GB = 10^9 bytes.", "",
             f"{where} Software: {software()}.", "",
             f"`tests/test_gpu.py`: {tests}", "",
             "MNIST: one training epoch (evaluation and start-up not counted), global batch 64.", "",
             "| run | precision | train s | samples/s | test accuracy |", "|---|---|---:|---:|---:|"]
    for (name, precision), r in mnist.items():
        cell = precision_cell(precision, r.get("ran_as", precision))
        if "failed" in r:
            lines.append(f"| {name} | {cell} | failed: {r['failed']} | | |")
        else:
            lines.append(f"| {name} | {cell} | {r['seconds']:.1f} | {r['samples_per_s']:.0f} | {r['accuracy']:.2f}% |")
    lines += ["", *bert_table(bert, device, toy=cpu)]
    if loader is not None:
        lines += ["", "Does the input pipeline keep up? [`benchmarks/loader_speed.py`](../benchmarks/loader_speed.py) at 1 "
                  "rank: the MNIST step fed by 0 to 4 DataLoader workers (classic per-sample loader), beside the step "
                  "alone and the loader alone ([Data that resumes exactly](data_pipeline.md#feeding-the-device)).", "",
                  *loader.get("lines", [f"failed: {loader.get('failed')}"])]
    lines += ["", f"The whole check took {seconds / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"


def write_results(path: Path, section: str) -> None:
    """Into the page between its two markers, so that the page's own text stays; a file without them gets the
    section alone."""
    text = path.read_text() if path.is_file() else ""
    if RESULTS_START in text and RESULTS_END in text:
        before, rest = text.split(RESULTS_START, 1)
        section = f"{before}{RESULTS_START}\n{section}{RESULTS_END}{rest.split(RESULTS_END, 1)[1]}"
    path.write_text(section)


def failed_rows(mnist: dict, bert: dict, loader: dict | None = None) -> list[str]:
    return [f"{name} ({precision})" for (name, precision), r in mnist.items() if "failed" in r] + \
           [f"BERT-base {precision}" for precision, r in bert.items() if "failed" in r] + \
           (["the loader benchmark"] if loader and "failed" in loader else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data", help="folder holding MNIST/raw, on this machine (default: data)")
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"the page to write (default: {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--cpu", action="store_true",
                        help="every row's code path on the CPU at toy size, without tests/test_gpu.py (the test suite's check)")
    parser.add_argument("--tests-timeout", type=int, default=PYTEST_TIMEOUT, metavar="SECONDS",
                        help=f"stop tests/test_gpu.py after this long and go on with the rows, on a GPU lent for a "
                             f"limited time (default: {PYTEST_TIMEOUT})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    problems, output = [], ""
    if args.cpu:
        device = torch.device("cpu")
        tests = "not run (`--cpu`: the CPU suite runs it itself, where its tests skip)"
    else:
        count = torch.cuda.device_count()
        stop = gpu_decision(nvidia_smi_listing() if not count else None, os.environ, count)
        if stop:
            status, sentence = stop
            if status:
                sys.exit(sentence)
            print(sentence)
            return
        device = torch.device("cuda")
        with tempfile.TemporaryDirectory() as cache:
            tests, problem, output = run_gpu_tests(gpu_tests_env(os.environ, count, cache), args.tests_timeout)
        print(f"tests/test_gpu.py: {tests}", flush=True)
        problems += [problem] if problem else []
        output = output if problem else ""  # the end of pytest's output where it did not pass
    mnist = mnist_rows(args.data_dir, device, jobs=2 if args.cpu else 1)  # --cpu: 2 at once, a 2-core CPU's
    bert = bert_rows(device, toy=args.cpu)
    loader = loader_rows(args.data_dir, toy=args.cpu)
    name = machine_name(torch.device("cuda", 0) if device.type == "cuda" else None)
    write_results(args.output, results(tests, mnist, bert, name, time.perf_counter() - start, cpu=args.cpu, loader=loader))
    print(args.output.read_text())
    failed = failed_rows(mnist, bert, loader)
    if failed:
        problems.append(f"{len(failed)} row(s) failed, each written with its reason: {', '.join(failed)}.")
    if problems:
        sys.exit("error: " + " ".join(problems) + (f"\nThe end of pytest's output:\n{output}" if output else ""))


if __name__ == "__main__":
    main()
