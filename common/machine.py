"""The name of the machine a number was measured on, to print beside every measured number."""
import os
import platform
from pathlib import Path

import torch


def machine_name(device: torch.device | None = None) -> str:
    """The accelerator's name (a CUDA or XPU device); otherwise the CPU's model name (from /proc/cpuinfo on
    Linux) and its core count."""
    named = getattr(torch.get_device_module(device), "get_device_name", None) if device is not None else None
    if device is not None and device.type != "cpu" and named is not None:
        return named(device)
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core {name}"
