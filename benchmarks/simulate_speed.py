"""How long `python -m planner.simulate` takes, and how much host memory, for models no laptop could hold.

Each case is one `python -m planner.simulate ... --json` process, timed from the outside; its peak
resident set comes from the kernel (os.wait4's ru_maxrss, the child's own, in KiB on Linux). The 70 B
case is Llama-shaped (80 layers, hidden 8192, MLP 28672, 64 heads, 8 KV heads, vocabulary 128,256, an
untied head), written as a config.json here: nothing is downloaded.

    python benchmarks/simulate_speed.py --plot simulate_speed.png
    python benchmarks/simulate_speed.py --cases 8b:fsdp:64   # one case: SIZE:STRATEGY:GPUS[:recompute]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from plotting import bar_chart, where_measured

LLAMA = {  # Llama-3-shaped configs: the sizes a reader rents GPUs for
    "8b": {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32},
    "70b": {"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64},
    "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8},  # the test's
}
COMMON = {"num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192,
          "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 0, "eos_token_id": 0}
CASES = ["70b:fsdp:1024", "70b:fsdp:1024:recompute", "70b:hsdp:1024", "8b:fsdp:64", "8b:zero3:64"]


def write_config(folder: Path, size: str) -> Path:
    path = folder / size
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**COMMON, **LLAMA[size]}, indent=1))
    return path


def run_case(case: str, folder: Path, seq: int) -> dict:
    size, strategy, gpus, *recompute = case.split(":")
    command = [sys.executable, "-m", "planner.simulate", "--model", str(write_config(folder, size)), "--gpus", gpus,
               "--strategy", strategy, "--seq", str(seq), "--json", *(["--recompute"] if recompute else [])]
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(2) as pipes:  # drain both pipes while os.wait4 reaps the child with its own usage
        out, err = pipes.submit(process.stdout.read), pipes.submit(process.stderr.read)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - began
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{err.result()[-2000:]}")
    [result] = json.loads(out.result())
    return {"case": case, "seconds": seconds, "rss_gb": usage.ru_maxrss * 1024 / 1e9, **result}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=CASES,
                        help=f"SIZE:STRATEGY:GPUS, SIZE one of {', '.join(LLAMA)}; :recompute after it checkpoints each block")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence, one sequence per rank (default: 2048)")
    parser.add_argument("--plot", help="also save a bar chart of the seconds per case to this PNG")
    args = parser.parse_args()
    for case in args.cases:
        parts = case.split(":")
        if len(parts) not in (3, 4) or parts[0] not in LLAMA or not parts[2].isdigit() or parts[3:] not in ([], ["recompute"]):
            parser.error(f"--cases {case}: write SIZE:STRATEGY:GPUS or SIZE:STRATEGY:GPUS:recompute, e.g. 70b:fsdp:1024")
    with tempfile.TemporaryDirectory() as folder:
        rows = [run_case(case, Path(folder), args.seq) for case in args.cases]
    print(f"One simulation per case (the model built, two steps run), {where_measured()}; GB = 10^9 bytes; per rank, as simulated")
    print("| case | parameters | seconds | host peak GB | params GB | grads GB | optimizer GB | peak GB | collectives |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        measured = row["measured"]
        calls = ", ".join(f"{c['count']} {c['kind'].replace('_', '-')}" for c in measured["collectives"])
        print(f"| {row['case']} | {row['params'] / 1e9:.1f} B | {row['seconds']:.1f} | {row['rss_gb']:.2f} "
              f"| {measured['param_bytes'] / 1e9:.3f} | {measured['grad_bytes'] / 1e9:.3f} "
              f"| {measured['optimizer_bytes'] / 1e9:.3f} | {measured['peak_bytes'] / 1e9:.2f} | {calls} |")
    if args.plot:
        bar_chart({row["case"]: row["seconds"] for row in rows},
                  [f"{row['seconds']:.0f} s, {row['rss_gb']:.1f} GB host" for row in rows],
                  "seconds for one simulation (lower is better)", f"planner.simulate, {where_measured()}", args.plot)


if __name__ == "__main__":
    main()
