"""Checkpoints a killed job can resume from exactly, and that a kill during the save cannot corrupt.

The chapter script says what a checkpoint holds (weights, optimizer, scheduler, loss scaler, where the
run was). This module does what is easy to get wrong:
  - each rank's own random-number generators (torch CPU, CUDA, Python `random`) are gathered to rank 0
    and given back to the same rank: the ranks draw different dropout masks, so restoring rank 0's
    state everywhere would change the run. A run resumed at another world size cannot have them back
    (no rank of it trains on what the same rank did before): every rank is reseeded from the seed,
    its rank and the step instead, so that the same resume is the same run each time;
  - rank 0 writes a temporary file, flushes and fsyncs it, renames it into place and fsyncs the folder,
    so a checkpoint file is either complete or absent; the last KEEP are kept, and only after the new
    one is safely on disk is the oldest deleted;
  - loading takes the newest checkpoint that torch.load(weights_only=True) accepts and says which,
    skipping (with a warning) a corrupt file or a temporary one left by a kill during a save;
  - a checkpoint for another global batch, dataset, seed or precision stops the run with one sentence
    instead of resuming into a different run. Another world size is not refused: the position is a
    global sample cursor (common/samplers.py), the same at any world size that divides the global batch;
  - a rerun over the checkpoint a finished run left says so and trains nothing, rather than print a
    training of 0 s and the old run's accuracy as its own result.
The folder must be one that every node sees (a shared filesystem): rank 0 picks the file, all ranks read it.
"""
import os
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import exit_process, processes, rank

KEEP = 2
NAME = re.compile(r"step-(\d+)\.pt")


@dataclass
class Position:
    """Where training is: the epoch, the samples of it that all ranks together have trained on (a
    global cursor: it means the same at any world size), and optimizer steps since the start."""
    epoch: int = 0
    samples_done: int = 0
    step: int = 0

    def advance(self, global_batch: int, epoch_samples: int) -> None:
        """One optimizer step of all ranks further; after an epoch's last (maybe short) batch, the
        position is the next epoch's start."""
        self.step += 1
        self.samples_done += global_batch
        if self.samples_done >= epoch_samples:
            self.epoch, self.samples_done = self.epoch + 1, 0


def rng_state(device: torch.device) -> dict:
    """The CPU's and Python's random states, and the accelerator's under its type ("cuda", "xpu", "mps")."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type != "cpu":
        state[device.type] = torch.get_device_module(device).get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device).set_rng_state(state[device.type], device)


def reseed(seed: int, rank: int, step: int) -> None:
    """A fresh random state for a rank of a run resumed at another world size: one number drawn from
    (seed, rank, step), so that ranks differ, a later change of size differs from this one, and the
    same resume is the same run each time."""
    value = random.Random(f"{seed} {rank} {step}").getrandbits(63)
    torch.manual_seed(value)  # the CPU's generator and every GPU's
    random.seed(value)


def another_run(saved: dict, now: dict) -> str | None:
    """What differs between the settings a checkpoint was written with and this run's, as "key X there,
    Y here, ..."; None where they agree."""
    different = [f"{key} {saved.get(key)} there, {value} here" for key, value in now.items() if saved.get(key) != value]
    return ", ".join(different) or None


def exit_finished(folder: Path, position: Position, longer: str | None) -> None:
    """End every rank where the newest checkpoint is the end of the run: a rerun of a finished command
    (a requeued job, or a user's second try) has nothing to train. `longer` says how to train on, if it can."""
    if rank() == 0:
        how = f"pass {longer} to train on, or another --checkpoint-dir to start afresh" if longer else \
            "pass another --checkpoint-dir to start afresh"
        print(f"nothing to train: the run in {folder} ended at step {position.step}, and its trained weights are in "
              f"{folder / 'final.pt'}; {how}.", flush=True)
    if dist.is_initialized():
        dist.barrier()
    exit_process(0)


def _gather_to_rank0(obj) -> list | None:
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _broadcast_from_rank0(obj):
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def write_atomically(obj, path: Path) -> None:
    """torch.save to a temporary file, fsync, rename over path, fsync the folder: all of it or nothing."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:  # disk full, say: leave no half-written file behind
        temporary.unlink(missing_ok=True)
        raise
    os.replace(temporary, path)  # atomic on POSIX: a reader sees the old name list or the new one
    fsync_folder(path.parent)  # the rename itself survives a crash of the machine


def fsync_folder(folder: Path) -> None:
    """Make the folder's list of names (a new name, a rename) durable, as fsync does for a file's bytes."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def checkpoints_in(folder: Path, name: re.Pattern = NAME) -> list[Path]:
    """Finished checkpoints in folder, newest (highest step) first."""
    found = [path for path in folder.glob("step-*") if name.fullmatch(path.name)]
    return sorted(found, key=lambda path: int(name.fullmatch(path.name).group(1)), reverse=True)


class Checkpoints:
    """The checkpoints of one run in one folder, checked against what this run must share with them.

    A checkpoint here is one file that rank 0 writes; common/sharded_checkpoint.py changes what a
    checkpoint is (a folder of every rank's shards) and keeps the rest."""
    NAME, SUFFIX = NAME, ".pt"

    def __init__(self, folder: str, every: int, fingerprint: dict, device: torch.device):
        self.folder, self.every, self.device = Path(folder), every, device
        self.fingerprint = fingerprint
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)

    def due(self, position: Position) -> bool:
        return position.step % self.every == 0

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step:08d}{self.SUFFIX}"

    def save(self, position: Position, state: dict) -> None:
        """Every rank calls this at the same step; rank 0 writes, then all wait until the checkpoint is in place."""
        ranks = _gather_to_rank0(rng_state(self.device))
        metadata = {"position": asdict(position), "world_size": self.world_size, "device": self.device.type,
                    "fingerprint": self.fingerprint, "rng": ranks}
        self._write(self.path(position.step), state, metadata)
        if rank() == 0:
            for old in checkpoints_in(self.folder, self.NAME)[KEEP:]:
                self._delete(old)
        if dist.is_initialized():
            dist.barrier()

    def _write(self, path: Path, state: dict, metadata: dict) -> None:
        if rank() == 0:
            write_atomically({**state, **metadata}, path)

    def _delete(self, path: Path) -> None:
        path.unlink()

    def _read(self, path: Path) -> dict:
        """The checkpoint's metadata (position, world size, fingerprint, device, random states) and here all the rest."""
        return torch.load(path, map_location="cpu", weights_only=True)

    def save_final(self, model_state: dict) -> Path:
        """The trained weights alone, as DIR/final.pt: what a user loads for inference, on any machine, so the
        tensors are saved from the CPU (a CUDA tensor in the file makes torch.load fail where there is no GPU)."""
        path = self.folder / "final.pt"
        if rank() == 0:
            write_atomically({name: value.cpu() for name, value in model_state.items()}, path)
        return path

    def load_newest(self) -> dict | None:
        """The newest checkpoint that loads, with this rank's RNG state restored; None on a fresh start."""
        found = self._find_newest()
        if found is None:
            return None
        state, path = found
        self._resumed(state, path)
        return state

    def exit_if_finished(self, position: Position, finished: bool, longer: str | None = None) -> None:
        """A rerun over a finished run's checkpoint: say so, and end every rank (exit_finished)."""
        if finished:
            exit_finished(self.folder, position, longer)

    def _find_newest(self) -> tuple[dict, Path] | None:
        """Rank 0 picks the newest checkpoint that loads; every rank reads it and checks that it is this run's."""
        state, name = self._newest_that_loads() if rank() == 0 else (None, None)
        name = _broadcast_from_rank0(name)
        if name is None:
            return None
        path = self.folder / name
        if state is None:  # ranks other than 0 read the checkpoint rank 0 chose
            try:
                state = self._read(path)
            except Exception as error:  # missing on this node, or read while being replaced
                sys.exit(f"error: rank {rank()} cannot read {path}, which rank 0 read ({type(error).__name__}); "
                         "--checkpoint-dir must be on a filesystem that every node sees.")
        self._check(state, path)
        if state["device"] != self.device.type and rank() == 0:
            print(f"warning: {path} was written on {state['device']} and this run is on {self.device.type}: "
                  "it continues from there, with the random state of the CPU only, so not bitwise as it would "
                  "have been", file=sys.stderr)
        return state, path

    def _resumed(self, state: dict, path: Path) -> None:
        """Give this rank its own random state back, or a new one at another world size, and say where
        the run continues."""
        position = Position(**state["position"])
        if state["world_size"] == self.world_size:
            set_rng_state(state["rng"][rank()], self.device)
        else:
            reseed(self.fingerprint.get("seed", 0), rank(), position.step)
        if rank() == 0:
            print(f"resumed from {path}: epoch {position.epoch}, {position.samples_done} samples into it, "
                  f"step {position.step}", flush=True)
            if state["world_size"] != self.world_size:
                print(f"written by {processes(state['world_size'])}, continued by {self.world_size}: the same "
                      f"global batch and data order; each rank's random state reseeded from seed, rank and step",
                      flush=True)

    def _newest_that_loads(self) -> tuple[dict | None, str | None]:
        for leftover in self.folder.glob("*.tmp"):
            print(f"warning: ignoring {leftover}, left by a save that did not finish", file=sys.stderr)
        for path in checkpoints_in(self.folder, self.NAME):
            try:
                return self._read(path), path.name
            except Exception as error:  # truncated, corrupt, or not a checkpoint: try the one before
                print(f"warning: skipping {path}: it does not load ({type(error).__name__})", file=sys.stderr)
        return None, None

    def _check(self, state: dict, path: Path) -> None:
        """Another run's checkpoint (the folder may hold one), or one whose position this code does not
        read (written before the position became a global cursor), is refused; another world size is not."""
        if set(state["position"]) != set(Position.__dataclass_fields__):
            sys.exit(f"error: {path} was written by an older version of these scripts (its position holds "
                     f"{', '.join(sorted(state['position']))}); finish that run with the code that started it, "
                     "or start afresh with another --checkpoint-dir.")
        if different := another_run(state["fingerprint"], self.fingerprint):
            sys.exit(f"error: {path} belongs to another run ({different}); resume with the same settings, "
                     f"or start afresh with another --checkpoint-dir.")
