"""torch.compile behind one flag, --compile [BACKEND] (common/cli.py), and one sentence where it cannot work.

The scripts compile after the DDP wrap (torch.compile(DDP(model))), the order torch's DDP notes give,
which also leaves model.module the plain model for evaluation and saving. Either order splits the
captured graph at DDP's bucket boundaries (torch/_dynamo/backends/distributed.py, DDPOptimizer), so
that each bucket's all-reduce can still start while the backward of the earlier layers runs: dynamo
applies DDPOptimizer to whatever it compiles while a DDP forward is running
(DistributedDataParallel._get_active_ddp_module(), checked in torch/_dynamo/convert_frame.py), and in
DDP(torch.compile(model)) the compiled model runs inside DDP's forward too.
"""
import atexit
import gc
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from common.distributed import accelerator_type

COMPILERS = ("g++", "clang++", "c++")  # what inductor's C++ builder looks for on the PATH (CPU kernels)
C_COMPILERS = ("gcc", "clang")  # what Triton builds its kernel launchers with (GPU kernels), unless $CC names one


def check_backend(backend: str, kind: str | None = None, environ=os.environ,
                  python_include: str | None = None) -> None:
    """Stop with one sentence and the way out where torch.compile cannot work on this machine.

    kind is the device type the model runs on ("cuda", "xpu", "cpu"), by default this machine's
    accelerator: inductor writes C++ for a CPU and Triton for a GPU, and Triton compiles a small C
    launcher per kernel against Python's headers, so a GPU needs a C compiler and Python.h instead.
    """
    if not torch._dynamo.is_dynamo_supported():
        sys.exit(f"error: torch {torch.__version__} cannot compile on this Python or platform; "
                 "leave out --compile (the model runs eagerly, with the same results).")
    if backend != "inductor":
        return
    kind = accelerator_type() if kind is None else kind
    if kind in ("cuda", "xpu"):
        if not (environ.get("CC") or any(shutil.which(name) for name in C_COMPILERS)):
            sys.exit("error: --compile inductor on a GPU builds Triton kernels, which need a C compiler (gcc or "
                     "clang) on the PATH or named by $CC; install one (e.g. apt install gcc), or pass --compile "
                     "aot_eager, or leave out --compile.")
        include = Path(python_include or sysconfig.get_paths()["include"])
        if not (include / "Python.h").exists():
            sys.exit(f"error: --compile inductor on a GPU builds Triton kernels against Python's headers, and "
                     f"{include / 'Python.h'} is missing; install them (e.g. apt install python3-dev), or pass "
                     "--compile aot_eager, or leave out --compile.")
    elif not any(shutil.which(name) for name in COMPILERS):
        sys.exit("error: --compile inductor generates C++ and needs a C++ compiler (g++ or clang++) on the PATH; "
                 "install one (e.g. apt install g++), or pass --compile aot_eager, or leave out --compile.")


def compiled(module: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    """torch.compile(module) with this backend; the module itself where backend is None (no --compile)."""
    if backend is None:
        return module
    check_backend(backend)
    atexit.register(release_compiled_code)
    return torch.compile(module, backend=backend)


def release_compiled_code() -> None:
    """Drop dynamo's compiled code as the process exits, before the interpreter's teardown.

    Its caches hold the compiled module, and a DDP module's process group with it, past
    destroy_process_group(): gloo's threads would still run while the interpreter ends, and the process
    would abort now and then ("terminate called without an active exception", docs/traps.md). What they
    hold is in reference cycles, hence the collection."""
    torch._dynamo.reset()
    gc.collect()


def compile_in_place(module: torch.nn.Module, backend: str | None) -> None:
    """Module.compile(): the module stays the same object (and keeps FSDP2's hooks, which run eagerly,
    between the compiled forwards); nothing where backend is None."""
    if backend is not None:
        check_backend(backend)
        module.compile(backend=backend)
