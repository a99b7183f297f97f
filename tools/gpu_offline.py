"""gpu-check on a GPU machine with no package index (`make gpu-check-offline`): the machine's own python3 as it
is (no venv, nothing of this project installed), the repository on PYTHONPATH, and from the wheelhouse
.gpu/wheels only what that python3 lacks, installed with `pip --no-index --no-deps` into .gpu/site (ignored
by git, like .gpu/wheels). Then tools/gpu_check.py, with the arguments after `--`.

    python3 tools/gpu_offline.py -- --data-dir data        # what make gpu-check-offline DATA_DIR=data runs
    python3 tools/gpu_offline.py --dry-run                 # what it would install, and from which wheel

The check needs the core dependencies (torch, torchvision, transformers, accelerate, lightning, tqdm) and
pytest with pytest-xdist and pytest-timeout: without one of them, and without its wheel, it stops with one
sentence. Its rows import no `datasets`; tests/test_gpu.py's BERT tests do (common/nli.py reads the pairs
with it), its fault-tolerant tests import torchft and its DeepSpeed tests deepspeed, so a machine without them
needs the wheels that `make gpu-wheels` downloads (and, for DeepSpeed, an sdist, builds) on a machine with the
index: datasets, dill and multiprocess, torchft and its opentelemetry packages, DeepSpeed and its needs, about
10 MB for Python 3.12 (datasets' other needs, pyarrow and
pandas among them, come with a usual GPU image; where one is missing, its wheel goes into .gpu/wheels too).
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS, SITE = ROOT / ".gpu" / "wheels", ROOT / ".gpu" / "site"
# distribution -> the module it installs
CORE = {"torch": "torch", "torchvision": "torchvision", "transformers": "transformers", "accelerate": "accelerate",
        "lightning": "lightning", "tqdm": "tqdm", "pyyaml": "yaml", "pytest": "pytest", "pytest-xdist": "xdist",
        "pytest-timeout": "pytest_timeout"}
FOR_GPU_TESTS = {  # what tests/test_gpu.py's BERT tests (datasets), fault-tolerant tests (torchft) and DeepSpeed tests import
    "datasets": "datasets", "dill": "dill", "multiprocess": "multiprocess",
    "torchft": "torchft", "opentelemetry-api": "opentelemetry.trace", "opentelemetry-sdk": "opentelemetry.sdk",
    "opentelemetry-semantic-conventions": "opentelemetry.semconv", "opentelemetry-proto": "opentelemetry.proto",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry-exporter-otlp-proto-common": "opentelemetry.exporter.otlp.proto.common",
    "opentelemetry-exporter-otlp-common": "opentelemetry.exporter.otlp.common",
    "opentelemetry-exporter-http-transport": "opentelemetry.exporter.http.transport",
    "googleapis-common-protos": "google.api",
    "deepspeed": "deepspeed", "hjson": "hjson", "msgpack": "msgpack", "ninja": "ninja", "py-cpuinfo": "cpuinfo",
    "einops": "einops", "pydantic": "pydantic", "pydantic-core": "pydantic_core", "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection", "psutil": "psutil"}


def wheel_for(distribution: str, wheels: list[Path]) -> Path | None:
    """The wheel of a distribution in the wheelhouse (names normalized as wheels spell them: pytest_xdist-...)."""
    name = re.sub(r"[-_.]+", "_", distribution).lower()
    return next((wheel for wheel in sorted(wheels) if wheel.name.lower().split("-")[0] == name), None)


def plan(present, wheels: list[Path]) -> tuple[list[Path], list[str], list[str]]:
    """What to install (the wheels of what is missing), what stops the check (a core package missing, with no
    wheel) and what only its BERT tests miss; present(module) says whether this python imports it."""
    install, stop, warn = [], [], []
    for needed, missing_is in ((CORE, stop), (FOR_GPU_TESTS, warn)):
        for distribution, module in needed.items():
            if present(module):
                continue
            wheel = wheel_for(distribution, wheels)
            if wheel:
                install.append(wheel)
            else:
                missing_is.append(distribution)
    return install, stop, warn


def importable(module: str) -> bool:
    """Whether this python imports the module; a dotted name whose package is missing is not importable."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="the wheelhouse (default: .gpu/wheels)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed, install and run nothing")
    parser.add_argument("check", nargs=argparse.REMAINDER, help="-- then tools/gpu_check.py's arguments")
    args = parser.parse_args(argv)
    check = args.check[1:] if args.check[:1] == ["--"] else args.check
    sys.path[:0] = [str(SITE)]  # what an earlier run installed counts as present
    install, stop, warn = plan(importable,
                               list(args.wheels.glob("*.whl")) if args.wheels.is_dir() else [])
    print(f"gpu-check offline: {sys.executable}; from {args.wheels}: "
          + (", ".join(wheel.name for wheel in install) or "nothing to install"), flush=True)
    if stop:
        sys.exit(f"error: this python lacks {', '.join(stop)}, which gpu-check needs, and {args.wheels} holds no wheel "
                 f"of {'them' if len(stop) > 1 else 'it'}: put wheels for this python there (pip download on a machine "
                 f"with the index).")
    if warn:
        print(f"warning: no {', '.join(warn)} here nor in {args.wheels}: the tests of tests/test_gpu.py that need them skip "
              f"(BERT: datasets; the fault-tolerant rungs: torchft; the DeepSpeed rungs: deepspeed); "
              f"`make gpu-wheels` on a machine with the index downloads the wheels.", flush=True)
    if args.dry_run:
        return
    if install:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(SITE), *map(str, install)], check=True)
    path = [str(ROOT), str(SITE), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    sys.exit(subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), *check], cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
