"""DeepSpeed for the sharded chapter's rungs: the config a run's flags make, and its checkpoints' extras.

deepspeed.initialize takes the whole training set-up as one dict (a JSON file, usually). Three of its
rules surprise a reader coming from DDP, and this module states each once:
  - train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x the
    world size, or initialize stops with an AssertionError: the rungs check a user's file first and
    say which numbers disagree;
  - gradient_clipping defaults to 1.0 (DeepSpeed 0.19), where DDP clips nothing: the rungs always pass
    it, 0 (off) for MNIST and --max-grad-norm for BERT, so that each stage trains DDP's weights;
  - "bf16" and "fp16" make the engine hold 16-bit parameters with fp32 masters in the optimizer, and
    fp16 adds DeepSpeed's own loss scaling (no GradScaler). The engine's forward turns an autocast around
    it off, so floating-point inputs must come in the weights' dtype (input_dtype). The CPU has no fp16:
    common.precision refuses it.
"""
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from common.checkpoint import KEEP, another_run, checkpoints_in
from common.cli import DEFAULT_STAGE, STAGES

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
TAG = re.compile(r"step-(\d+)")  # the rungs' checkpoint tags: DeepSpeed itself keeps every tag it saves


def require_deepspeed():
    """import deepspeed, or one sentence saying how to install it."""
    try:
        import deepspeed
    except ImportError:
        sys.exit("error: this script needs DeepSpeed, which is not installed: "
                 "pip install -e '.[deepspeed]' (or pip install deepspeed==0.19.8).")
    return deepspeed


def deepspeed_config(args, world_size: int, precision: str, max_grad_norm: float = 0.0) -> dict:
    """The config of this run: what the flags say, with --deepspeed-config's keys laid over it, checked."""
    config = {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": args.batch_size // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": DEFAULT_STAGE},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "steps_per_print": 10**9,  # no DeepSpeed progress lines: the script prints its own
    }
    user = read_config(args.deepspeed_config) if args.deepspeed_config else {}
    for key, value in user.items():
        config[key] = {**config[key], **value} if isinstance(config.get(key), dict) and isinstance(value, dict) else value
    stage = config["zero_optimization"].get("stage")
    if args.zero_stage is not None:
        if "stage" in user.get("zero_optimization", {}) and stage != args.zero_stage:
            sys.exit(f"error: {args.deepspeed_config} sets ZeRO stage {stage} and --zero-stage says "
                     f"{args.zero_stage}: keep one of the two.")
        config["zero_optimization"]["stage"] = stage = args.zero_stage
    if stage not in STAGES:
        sys.exit(f"error: {args.deepspeed_config} sets ZeRO stage {stage!r}; DeepSpeed has stages 0, 1, 2 and 3.")
    asked = tuple(config[key] for key in BATCH_KEYS)
    if asked != (args.batch_size, args.batch_size // world_size, 1):
        sys.exit(f"error: {args.deepspeed_config} asks for {', '.join(f'{k} {v}' for k, v in zip(BATCH_KEYS, asked))}, "
                 f"and --batch-size {args.batch_size} on {world_size} processes is {args.batch_size // world_size} "
                 "per process, one micro-batch a step: leave the batch sizes out of the file, or make them say so.")
    return config


def input_dtype(precision: str) -> torch.dtype:
    """The dtype of the engine's weights, which its floating-point inputs must have."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        sys.exit(f"error: --deepspeed-config {path} is not a readable JSON file ({error}).")
    if not isinstance(config, dict):
        sys.exit(f"error: --deepspeed-config {path} must hold one JSON object, not a {type(config).__name__}.")
    return config


def refuse_another_run(folder: str | Path, world_size: int, fingerprint: dict) -> None:
    """Stop with one sentence where the newest checkpoint belongs to another run: one written at another world
    size (its shards, one file per rank at stages 1-3, and its random states belong to the ranks that wrote
    them), or under other settings (another ZeRO stage's shards do not load, and another precision or batch
    would resume into a different run). Nothing in the folder is touched."""
    newest = Path(folder) / (Path(folder) / "latest").read_text().strip()
    states = sorted(newest.glob("*mp_rank_00_model_states.pt"))  # client_state: rank 0's file (stage 3: every rank's)
    client = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True) if states else {}
    writers = len(list(newest.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))) or len(client.get("rng", ()))
    if writers != world_size:
        sys.exit(f"error: {newest} was written by {writers} processes and this run has {world_size}: a DeepSpeed "
                 f"checkpoint resumes at the world size that wrote it (python {Path(folder) / 'zero_to_fp32.py'} "
                 "turns it into whole weights to start from elsewhere).")
    if "fingerprint" not in client:
        sys.exit(f"error: {newest} was written by an older version of these scripts (it does not say which settings "
                 "wrote it); finish that run with the code that started it, or start afresh with another --checkpoint-dir.")
    if different := another_run(client["fingerprint"], fingerprint):
        sys.exit(f"error: {newest} belongs to another run ({different}); resume with the same settings, or start "
                 "afresh with another --checkpoint-dir.")


def remove_old_checkpoints(folder: str | Path, keep: int = KEEP) -> None:
    """Keep the newest `keep` step-N folders (rank 0 calls this after a save has completed everywhere)."""
    for old in checkpoints_in(Path(folder), TAG)[keep:]:
        shutil.rmtree(old)
