"""Trainer(devices=..., num_nodes=...) that agree with however the processes were started.

Lightning reads torchrun's and SLURM's variables itself and raises deep inside fit() when the
Trainer's numbers disagree with them: under torchrun devices x num_nodes must equal WORLD_SIZE, under
srun devices must equal --ntasks-per-node and num_nodes --nodes. So --devices and --num-nodes default
to what the launcher started (common/cli.py's add_lightning_flags), and a disagreement, or a launch Lightning would misread, stops with one
sentence before the Trainer exists. Started with plain python, --devices is how many processes
Lightning starts on this node (auto: every GPU, or one CPU process).
"""
import os
import sys

import torch

from common.distributed import accelerator_type, detect_launch

# SLURMEnvironment.detect() treats a job with one of these names as an interactive shell and ignores
# SLURM's variables. What salloc names its job depends on the site (often "interactive", or the command it runs).
INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def lightning_accelerator(kind: str | None = None) -> str:
    """Trainer(accelerator=...): "auto", Lightning's pick (a CUDA GPU where there is one, else the CPU), except
    where that pick would fail or silently take the CPU: on Apple's MPS device no DDP strategy runs, and
    Lightning 2.6 has no XPU accelerator built in. There the CPU, said in one line."""
    kind = accelerator_type() if kind is None else kind
    if kind in ("mps", "xpu"):
        print(f"note: Lightning's DDP strategy does not run on this {kind.upper()} device, so this step trains on "
              f"the CPU; python src/ch4/mnist_1_single.py trains on the {kind.upper()} device.", file=sys.stderr)
        return "cpu"
    return "auto"


def check_launch(devices: int | str, num_nodes: int, environ=os.environ, gpu_count: int | None = None) -> None:
    """Stop with one sentence where Lightning would raise in fit(), or misread the launch and hang."""
    launch = detect_launch(environ)
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count  # Lightning's "gpu" is CUDA
    if launch.launcher != "slurm" and devices != "auto" and 0 < gpus < devices:  # else Lightning's MisconfigurationException
        sys.exit(f"error: {devices} processes on this node need {devices} GPUs and {gpus} are visible: run "
                 f"{gpus} (--devices {gpus}, or torchrun --nproc_per_node={gpus}), or hide the GPUs with "
                 f"CUDA_VISIBLE_DEVICES= to run {devices} processes on the CPU.")
    if launch.launcher == "slurm" and environ.get("SLURM_JOB_NAME") in INTERACTIVE_JOB_NAMES:
        sys.exit(f"error: Lightning ignores SLURM's variables in a job named '{environ['SLURM_JOB_NAME']}' (an "
                 "interactive salloc shell), so the srun tasks would not form one process group; give the step "
                 "another name: srun -J train ... (or salloc -J train).")
    if launch.launcher == "slurm" and launch.world_size > 1 and "SLURM_NTASKS_PER_NODE" not in environ:
        sys.exit(f"error: Lightning refuses a SLURM job submitted with --ntasks={launch.world_size} alone; "
                 "ask for tasks per node instead: sbatch -N<nodes> --ntasks-per-node=<processes per node> ...")
    if launch.launcher == "python":
        return
    started = (launch.local_world_size, launch.world_size // launch.local_world_size)
    if (devices, num_nodes) != started:
        sys.exit(f"error: {launch.launcher} started {launch.world_size} processes, {started[0]} per node on "
                 f"{started[1]} node(s), but --devices {devices} --num-nodes {num_nodes} asks Lightning for "
                 f"another layout; leave both flags out to take the launcher's.")
