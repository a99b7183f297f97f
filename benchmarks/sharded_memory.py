"""Memory per rank under DDP, ZeRO-1/2/3 (common/lessons/zero.py) and FSDP2, measured beside the ZeRO formula.

For each world size N it starts N gloo processes on this machine and trains a BERT sequence classifier
(built from the --model folder's config, random weights: memory does not depend on their values) for
--steps AdamW steps in fp32 under each wrapper in turn, on random token ids. Per rank it reports
  - bytes of parameters, gradients and optimizer state: the storages of the tensors each holds,
    counted once each (FSDP2's DTensors by their local pieces); gradients right after backward,
    the others after a step;
  - peak memory above the start: the process's peak resident set (Linux VmHWM, reset through
    /proc/self/clear_refs before each wrapper's model is built) minus its resident set at that moment.
    glibc's mmap threshold is fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_) so that a freed tensor goes
    back to the system at once and the peak follows live tensors, not the allocator's free lists;
  - the median step time, the slowest rank's, and its ratio to DDP's in the same run.
The formula (ZeRO paper, fp32 with AdamW; planner.plan.memory_bytes): 4Ψ parameters + 4Ψ gradients + 8Ψ optimizer state on every
rank under DDP; ZeRO-1 divides the optimizer term by N, ZeRO-2 the gradients too, ZeRO-3 (and FSDP2)
all three. (In mixed precision it is 2Ψ + 2Ψ + 12Ψ: bf16 weights and gradients, and an fp32 master
copy with the two moments; these wrappers train in fp32.)
Sizes are in binary units, as the table's header line says: MiB = 2**20 bytes (KiB = 2**10 for a
model too small for MiB), in the table, the peak and the plot alike.

    python benchmarks/sharded_memory.py --model path/to/all-MiniLM-L6-v2/model --plot images/sharded_memory_cpu.png
"""
import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.fsdp import fully_shard_blocks
from common.lessons.zero import ZeRO
from common.memory import optimizer_tensors, storage_bytes
from common.spawn import run_in_process_group
from planner.plan import memory_bytes

RUNS = {"DDP": "ddp", "ZeRO-1": "zero1", "ZeRO-2": "zero2", "ZeRO-3": "zero3", "FSDP2": "fsdp"}  # -> planner.plan's
MiB, KiB = 2**20, 2**10  # the table's and the plot's units; /proc's VmRSS and VmHWM count KiB too


def memory_kb(field: str) -> int | None:
    """VmRSS or VmHWM of this process, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
    except OSError:
        return None


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def wrap(run: str, model):
    """The model under `run`; returns (the module to call, the optimizer, the tensors that are parameters)."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    if run == "local":  # no wrapper and no collective: the step's compute alone (plan_check.py calibrates on it)
        return model, adamw(model.parameters()), list(model.parameters())
    if run == "DDP":
        model = DDP(model)
        return model, adamw(model.parameters()), list(model.parameters())
    if run.startswith("ZeRO"):
        model = ZeRO(model, int(run[-1]), adamw)
        return model, model.optimizer, list(model.parameters()) + [unit.shard for unit in model.units]
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    fully_shard_blocks(model)
    return model, adamw(model.parameters()), list(model.parameters())


def measure(run: str, config, batch: int, length: int, steps: int) -> dict:
    from transformers import AutoModelForSequenceClassification
    gc.collect()
    start_kb = memory_kb("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer, params = wrap(run, model)
    step_of = model.step if run.startswith("ZeRO") else optimizer.step
    generator = torch.Generator().manual_seed(dist.get_rank())
    times, grads = [], None
    for step in range(steps):
        inputs = torch.randint(5, config.vocab_size, (batch, length), generator=generator)
        labels = torch.randint(0, config.num_labels, (batch,), generator=generator)
        dist.barrier()
        began = time.perf_counter()
        model(input_ids=inputs, labels=labels).loss.backward()
        if grads is None:  # gradients exist between backward and the step
            grads = storage_bytes([p.grad for p in params])
        step_of()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    peak_kb = memory_kb("VmHWM")
    state = optimizer_tensors(optimizer)
    result = {"psi": psi, "params": storage_bytes(params), "grads": grads, "optimizer": storage_bytes(state),
              "step_s": statistics.median(times[1:] if len(times) > 1 else times),
              "peak_mb": None if peak_kb is None else (peak_kb - start_kb) / 1024}
    del model, optimizer, params, state
    return result


def worker(rank, world_size, model_path, batch, length, steps):
    torch.set_num_threads(1)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path, num_labels=3)
    measure("DDP", config, batch, length, 2)  # a run to throw away: the first pays for loading kernels and libraries
    results = {run: measure(run, config, batch, length, steps) for run in RUNS}
    every_rank = [None] * world_size
    dist.all_gather_object(every_rank, results)
    return every_rank


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local model folder (its config.json is what is used)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--batch", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the timing")
    parser.add_argument("--plot", help="also save a figure of the bytes per rank to this PNG")
    parser.add_argument("--title", default="Memory per rank",
                        help="plot title; the machine's name is added after it")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the timing")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc in the processes started below
    rows = []
    for world_size in args.world_sizes:
        every_rank = run_in_process_group(worker, world_size, args.model, args.batch, args.length, args.steps,
                                               timeout=3600)
        psi = every_rank[0]["DDP"]["psi"]
        for run in RUNS:
            ranks = [results[run] for results in every_rank]
            worst = {key: max(rank[key] for rank in ranks) for key in ("params", "grads", "optimizer", "step_s")}
            peaks = [rank["peak_mb"] for rank in ranks]
            worst["peak_mb"] = None if None in peaks else max(peaks)
            rows.append((world_size, run, worst, memory_bytes(RUNS[run], psi, world_size, "fp32")))
    unit, size = ("MiB", MiB) if 4 * psi >= 10 * MiB else ("KiB", KiB)
    print(f"Ψ = {psi:,} parameters; {unit} = {size:,} bytes; measured (formula), the largest over ranks")
    print(f"| ranks | run | parameters {unit} | gradients {unit} | optimizer state {unit} | optimizer / formula "
          "| peak above start MiB | s per step | step time vs DDP |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    ddp_time = {n: worst["step_s"] for n, run, worst, _ in rows if run == "DDP"}
    for world_size, run, worst, formula in rows:
        cells = [f"{worst[key] / size:.1f} ({value / size:.1f})" for key, value in zip(("params", "grads", "optimizer"), formula)]
        peak = "n/a" if worst["peak_mb"] is None else f"{worst['peak_mb']:.0f}"
        print(f"| {world_size} | {run} | {' | '.join(cells)} | {worst['optimizer'] / formula[2]:.3f} | {peak} "
              f"| {worst['step_s']:.3f} | {worst['step_s'] / ddp_time[world_size]:.2f}x |")
    if args.plot:
        from plotting import stacked_memory_chart, where_measured
        stacked_memory_chart(rows, RUNS, f"{args.title}, gloo processes {where_measured()}", args.plot)


if __name__ == "__main__":
    main()
