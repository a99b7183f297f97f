"""The name of the machine a number was measured on, to print beside every measured number."""
import os
import platform
from pathlib import Path

import torch


def machine_name(device: torch.device | None = None) -> str:
    """The GPU's name for a CUDA device; otherwise the CPU's model name (from /proc/cpuinfo on Linux)
    and its core count."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core {name}"
