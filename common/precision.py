"""Mixed precision as one flag: fp32, bf16 or fp16 autocast, or auto (bf16 only where it is native).

bf16 autocast pays off only on hardware with bf16 units: Ampere-or-newer GPUs, and CPUs with AMX or
AVX512-BF16. On a CPU without them (AVX2 only), oneDNN emulates bf16 and a step gets several times
slower, so auto means fp32 there. fp16 needs a GradScaler, so that small gradients do not underflow,
and is offered on CUDA only.
"""
import sys

import torch


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    if requested == "fp16" and device.type != "cuda":
        sys.exit("error: --precision fp16 needs a CUDA GPU; on the CPU use --precision bf16 or fp32.")
    return requested


def autocast(device: torch.device, precision: str):
    """A torch.autocast context for the forward pass and the loss; a no-op for fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Loss scaling for fp16; disabled (each call passes through) for bf16 and fp32."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def accelerate_mixed_precision(requested: str) -> str | None:
    """--precision for Accelerator(mixed_precision=...): auto defers to `accelerate launch`'s config."""
    if requested == "auto":
        return None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"fp32": "no"}.get(resolve_precision(requested, device), requested)
