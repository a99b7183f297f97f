"""Checkpoints of a sharded state (FSDP2), written by every rank with torch.distributed.checkpoint (DCP).

Under FSDP no rank holds the whole model or optimizer state, so no rank can write the one file of
common/checkpoint.py. get_state_dict (torch.distributed.checkpoint.state_dict) returns the model and
optimizer state dicts with each tensor a DTensor, this rank's piece of it; dcp.save has each rank
write its own pieces into one folder, and rank 0 the folder's `.metadata` (what is where). What this
module adds to common/checkpoint.py, which does the rest (random state per rank, the run's
fingerprint and world size, the last KEEP kept, the newest that loads):
  - a checkpoint is a folder, complete or absent: dcp.save writes step-N.tmp/ (each file fsynced),
    rank 0 adds meta.pt (position, world size, fingerprint, device, every rank's random state)
    atomically, fsyncs the folder, renames it to step-N/ and fsyncs the parent. Saved again at the
    same step, the old step-N/ is first renamed aside to step-N.old/ and deleted only once the new one
    is in place, so a kill at any point leaves a complete step-N/ or step-N.old/, which rank 0 puts
    back before it picks a checkpoint (a folder cannot be renamed over another in one step);
  - loading: rank 0 picks the newest folder whose meta.pt loads and whose shard files are all there
    at the sizes .metadata lists; after the fingerprint and world-size checks, dcp.load reads into
    the state dicts of this run's model and optimizer, each rank its own pieces, in place.
At another world size dcp.load reshards: each rank of the new run reads, from whichever files hold
them, the pieces of every tensor that its new shard covers (.metadata says where each piece is).
"""
import re
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from common.checkpoint import Checkpoints, fsync_folder, write_atomically
from common.distributed import rank

METADATA = "meta.pt"


class ShardedCheckpoints(Checkpoints):
    NAME, SUFFIX = re.compile(r"step-(\d+)"), ""

    def _write(self, path: Path, state: dict, metadata: dict) -> None:
        temporary = path.with_name(path.name + ".tmp")
        if rank() == 0 and temporary.exists():  # a save killed midway: start it again from nothing
            shutil.rmtree(temporary)
        if dist.is_initialized():
            dist.barrier()  # before any rank creates the folder again
        dcp.save(state, checkpoint_id=temporary)  # collective; returns once rank 0 has written .metadata
        if rank() == 0:
            write_atomically(metadata, temporary / METADATA)
            fsync_folder(temporary)
            self._put_back_aside()  # left by a kill during an earlier save at the same step
            aside, replaced = path.with_name(path.name + ".old"), path.exists()
            if replaced:  # saved again at the same step (the end of training): the same state
                path.rename(aside)  # from here until the end a complete step-N/ or step-N.old/ is there
                fsync_folder(path.parent)
            temporary.rename(path)  # one rename: the folder appears whole
            fsync_folder(path.parent)
            if replaced:
                shutil.rmtree(aside)

    def _delete(self, path: Path) -> None:
        shutil.rmtree(path)

    def _put_back_aside(self) -> None:
        """After a kill during _write's swap: step-N.old/ back to step-N/ where that is missing, else removed."""
        for aside in self.folder.glob("step-*.old"):
            path = aside.with_name(aside.name.removesuffix(".old"))
            if path.exists():
                shutil.rmtree(aside)
            else:
                print(f"warning: putting back {aside} as {path.name}: a save at the same step did not finish",
                      file=sys.stderr)
                aside.rename(path)
                fsync_folder(self.folder)

    def _newest_that_loads(self) -> tuple[dict | None, str | None]:
        self._put_back_aside()  # a step-N.old/ may be the only step-N there is
        return super()._newest_that_loads()

    def _read(self, path: Path) -> dict:
        """meta.pt, once the folder's shards are known to be all there."""
        for item in FileSystemReader(path).read_metadata().storage_data.values():
            shard = path / item.relative_path
            if shard.stat().st_size < item.offset + item.length:
                raise EOFError(f"{shard} is truncated")
        return super()._read(path / METADATA)

    def load_newest(self, training_state) -> dict | None:
        """training_state() builds this run's state dicts to load into (only when there is a checkpoint:
        get_state_dict gives a fresh AdamW its state by a step with learning rate 0)."""
        found = self._find_newest()
        if found is None:
            return None
        metadata, path = found
        state = training_state()
        try:
            dcp.load(state, checkpoint_id=path)  # collective: each rank reads the pieces it holds
        except Exception as error:  # CheckpointException, on every rank, if one rank failed
            sys.exit(f"error: the shards of {path} do not load into this model ({type(error).__name__}); "
                     "remove that folder to resume from the one before.")
        self._resumed(metadata, path)
        return {**state, **metadata}
