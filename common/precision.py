"""Mixed precision as one flag: fp32, bf16 or fp16 autocast, or auto (what the hardware does natively).

The rule for auto, per device type (torch.accelerator has none):
  - CUDA: bf16 on compute capability 8.0 or newer (A100, H100, RTX 30xx and later). Older GPUs (V100,
    T4) only emulate bf16, so auto means fp16 with loss scaling there, as users of those cards expect.
  - XPU and MPS: bf16 where torch says the device supports it, else fp32.
  - CPU: bf16 with AMX or AVX512-BF16 units; without them oneDNN emulates it and a step gets several
    times slower, so fp32. An explicit --precision bf16 there trains in bf16 all the same, after one
    line on stderr that says so.
fp16 needs a GradScaler, so that small gradients do not underflow: it is offered on the devices whose
GradScaler torch has (CUDA, XPU, MPS), not on the CPU. fp32 means fp32: cuDNN's convolutions would
otherwise run in TF32 on Ampere and newer GPUs (its default), with a 10-bit mantissa.
"""
import os
import platform
import sys

import torch
import torch.nn as nn

from common.distributed import accelerator_type, detect_launch

AUTO_HELP = ("autocast dtype; auto = bf16 where the hardware has it natively (GPUs of compute capability >= 8.0, "
             "XPU and MPS devices that support it, CPUs with AMX/AVX512-BF16), fp16 with loss scaling on older "
             "CUDA GPUs, else fp32")
FP16_DEVICES = ("cuda", "xpu", "mps")  # where torch has a GradScaler


def auto_precision(device: torch.device, capability: tuple[int, int] | None = None,
                   has_bf16: bool | None = None) -> str:
    """The rule behind --precision auto; capability (CUDA) and has_bf16 (other devices) default to this machine's."""
    if device.type == "cuda":
        major, _ = capability or torch.cuda.get_device_capability(device)
        return "bf16" if major >= 8 else "fp16"
    native = device_has_bf16(device) if has_bf16 is None else has_bf16
    return "bf16" if native else "fp32"


def device_has_bf16(device: torch.device) -> bool:
    """bf16 units on this CPU (cpu_has_bf16), or bf16 support on this XPU or MPS device (torch's)."""
    if device.type == "cpu":
        return cpu_has_bf16()
    supported = getattr(torch.get_device_module(device), "is_bf16_supported", None)
    if supported is not None:
        return supported()
    return device.type == "mps" and torch.backends.mps.is_macos_or_newer(14, 0)


def cpu_has_bf16() -> bool:
    """bf16 units: AVX512-BF16 or AMX on x86, where oneDNN's own check (torch.ops.mkldnn._is_mkldnn_bf16_supported)
    also passes on AVX-512 CPUs without them, which only emulate bf16; oneDNN's check elsewhere (Arm's BF16 extension)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def resolve_precision(requested: str, device: torch.device, has_bf16: bool | None = None) -> str:
    """The precision a run uses: auto resolved by the rule above; fp16 refused where there is no GradScaler;
    bf16 on a CPU without bf16 units kept, with one line from rank 0 saying it is slow there (has_bf16
    defaults to this CPU's)."""
    if requested == "auto":
        requested = auto_precision(device, has_bf16=has_bf16)
    if requested == "fp16" and device.type not in FP16_DEVICES:
        sys.exit(f"error: --precision fp16 needs a GPU (CUDA, XPU or MPS) for its loss scaling; on the "
                 f"{device.type.upper()} use --precision bf16 or fp32.")
    if requested == "bf16" and device.type == "cpu" and not (cpu_has_bf16() if has_bf16 is None else has_bf16) \
            and detect_launch().rank == 0:
        print("warning: this CPU has no bf16 units (AVX512-BF16 or AMX), so bf16 is emulated here and runs several "
              "times slower than fp32; training in bf16 as asked (--precision auto picks fp32 here)",
              file=sys.stderr, flush=True)
    if requested == "fp32":
        torch.backends.cudnn.allow_tf32 = False  # cuDNN's default runs fp32 convolutions in TF32
    return requested


def autocast(device: torch.device, precision: str):
    """A torch.autocast context for the forward pass and the loss; a no-op for fp32."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


class Autocast(nn.Module):
    """Run the wrapped module's forward under autocast, from inside the module.

    nn.DataParallel runs each replica's forward in a thread of its own, and the autocast state is per
    thread: each replica re-enters autocast with the device's default dtype (fp16 on CUDA), so a bf16
    autocast around the call silently becomes fp16, without a GradScaler. Inside forward, every
    replica's thread enters the requested autocast itself. (Replacing model.forward instead does not
    survive DataParallel's replication.)
    """

    def __init__(self, module: nn.Module, device: torch.device, precision: str):
        super().__init__()
        self.module, self.device, self.precision = module, device, precision

    def forward(self, *args, **kwargs):
        with autocast(self.device, self.precision):
            return self.module(*args, **kwargs)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Loss scaling for fp16; disabled (each call passes through) for bf16 and fp32."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """scaler.step and scaler.update; False where fp16 loss scaling skipped the step (inf or nan
    gradients), so that the caller does not advance its learning-rate schedule for a step not taken."""
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    return scale is None or scaler.get_scale() >= scale


def accelerate_mixed_precision(requested: str, environ=os.environ) -> str:
    """--precision for Accelerator(mixed_precision=...), with the same auto as the other scripts.

    auto takes the launch config's mixed_precision where it names one (fp16 or bf16), and otherwise
    the hardware rule above, so that the same GPU trains in the same precision in every script.
    """
    device = torch.device(accelerator_type() or "cpu")
    launched = environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if requested == "auto" and launched in ("fp16", "bf16"):
        requested = launched
    precision = resolve_precision(requested, device)
    return "no" if precision == "fp32" else precision


LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning_precision(requested: str) -> str:
    """--precision for Trainer(precision=...), with the same auto as the other scripts, on the device that
    Trainer picks (common.lightning_launch.lightning_accelerator): a CUDA GPU where there is one, else the CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return LIGHTNING_PRECISION[resolve_precision(requested, device)]
