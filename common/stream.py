"""MNIST as a stream of Parquet shards, read as a Hugging Face `datasets` IterableDataset, that resumes exactly.

A stream has no length and no index to start from: where a rank is, is each of its workers' place in its
shards. `datasets` knows that place (IterableDataset.state_dict), but its own shuffle buffer is not part of
it: its state_dict docstring says that examples in a shuffle buffer are lost on resume and the buffer is
refilled, so a resumed run would skip what the buffer held. ShuffleBuffer here keeps its buffer, its
generator and the source's place together, as one worker's state that StatefulDataLoader collects.
The end of an epoch is the other trap: ranks whose shares of the stream differ run out at different
steps, and the rank with a batch left waits in DDP's all-reduce for peers that have left the loop, until
the process group's timeout. every_rank_has ends the epoch on every rank at the first step where one
rank has no batch.
"""
import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from common.distributed import main_process_first
from common.flag_group import flag_group
from common.loader_state import refuse
from common.mnist import MEAN, STD

SHARDS = 12  # splits evenly over 1, 2, 3, 4 or 6 ranks and workers per rank together


def add_stream_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--stream-dir", default="data/mnist_stream",
                        help=f"folder of Parquet shards to stream; MNIST's training set is written there as {SHARDS} "
                             "shards if it holds none (default: data/mnist_stream)")
    parser.add_argument("--shuffle-buffer", type=int, default=1000,
                        help="rows each worker shuffles among; 1: the shards' order (default: 1000)")
    return parser


def shards_in(folder: str, train_set, local_rank: int) -> Path:
    """The folder, with MNIST's training set written into it by local rank 0 where it holds no shard."""
    folder = Path(folder)
    with main_process_first(local_rank):
        if local_rank == 0 and not any(folder.glob("*.parquet")):
            write_shards(train_set, folder)
    if not any(folder.glob("*.parquet")):
        refuse(f"error: {folder} holds files but no Parquet shards; pass an empty or new --stream-dir")
    return folder


def write_shards(train_set, folder: Path, sizes: list[int] | None = None) -> None:
    """The training images, labels and indices as Parquet files: SHARDS of (nearly) equal length, or one a size
    in `sizes`, in order (a test's unequal shards).

    All or nothing, for any number of writers at once (two runs started together on the default folder): each
    writes into a folder of its own beside `folder` and renames it to `folder` in one step, which succeeds where
    `folder` is missing or empty; a writer that finds another's shards there already drops its own. A reader sees
    no shard or every shard, never some."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pixels = (train_set.images.squeeze(1) * STD + MEAN).mul(255).round().clamp(0, 255).to(torch.uint8)
    cuts = np.cumsum(sizes)[:-1] if sizes else SHARDS
    shards = np.array_split(np.arange(sum(sizes) if sizes else len(train_set)), cuts)
    folder.parent.mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        for shard, indices in enumerate(shards):
            table = pa.table({"index": indices, "label": train_set.labels[indices].numpy(),
                              "image": [pixels[i].numpy().tobytes() for i in indices]})
            pq.write_table(table, own / f"train-{shard:05d}-of-{len(shards):05d}.parquet")
        try:
            own.rename(folder)
        except OSError:  # folder holds files: another writer's shards, or files of the user's own (shards_in says so)
            pass
    finally:
        shutil.rmtree(own, ignore_errors=True)  # ours, where another writer came first


def mnist_stream(folder: Path, rank: int, world_size: int, num_workers: int):
    """This rank's share of the shards, as an IterableDataset of {"index", "label", "image"} rows."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    files = sorted(str(path) for path in Path(folder).glob("*.parquet"))
    readers = world_size * max(num_workers, 1)
    if not files or len(files) % readers:
        refuse(f"error: {folder} holds {len(files)} Parquet shards, which do not split evenly over {world_size} "
               f"ranks x {max(num_workers, 1)} workers; pass a --stream-dir with a multiple of {readers} shards, "
               "or another --nproc_per_node or --num-workers.")
    stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
    # whole shards: rank r takes r, r + N, ... of each epoch's order (datasets shuffles it from epoch 1 on)
    return split_dataset_by_node(stream, rank=rank, world_size=world_size)


class ShuffleBuffer(IterableDataset):
    """The source's rows as (image, label, index), drawn at random from a buffer of `size` rows, each image
    shifted by up to `pixels`; the buffer, the generator and the source's place are its state_dict."""

    def __init__(self, source, size: int, pixels: int):
        self.source, self.size, self.pixels = source, size, pixels
        self.generator = torch.Generator()  # each worker's own (common/worker_seeds.py's seed_worker)
        self.buffer, self.resumed = [], None

    def set_epoch(self, epoch: int) -> None:
        self.source.set_epoch(epoch)

    def state_dict(self) -> dict:
        return {"source": self.source.state_dict(), "buffer": list(self.buffer), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.resumed = state

    def __iter__(self):
        if self.resumed:
            self.source.load_state_dict(self.resumed["source"])
            self.generator.set_state(self.resumed["generator"])
            self.buffer, self.resumed = list(self.resumed["buffer"]), None
        else:
            self.buffer = []
        for row in self.source:
            if len(self.buffer) < self.size:
                self.buffer.append(row)
                continue
            yield self.take(int(torch.randint(self.size, (), generator=self.generator)), row)
        while self.buffer:
            yield self.take(int(torch.randint(len(self.buffer), (), generator=self.generator)))

    def take(self, slot: int, replacement=None):
        row = self.buffer[slot]
        if replacement is None:
            self.buffer[slot] = self.buffer[-1]
            self.buffer.pop()
        else:
            self.buffer[slot] = replacement
        image = torch.frombuffer(bytearray(row["image"]), dtype=torch.uint8).view(1, 28, 28).float().div(255)
        image = (image - MEAN) / STD
        if self.pixels:
            rows, columns = torch.randint(-self.pixels, self.pixels + 1, (2,), generator=self.generator).tolist()
            image = torch.roll(image, shifts=(rows, columns), dims=(-2, -1))
        return image, row["label"], row["index"]


def every_rank_has(batch) -> bool:
    """True on every rank while every rank has a batch: one small all-reduce (MIN) a step, on the CPU over gloo."""
    flag = torch.tensor([batch is not None], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=flag_group())
    return bool(flag.item())
