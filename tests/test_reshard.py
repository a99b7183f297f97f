"""A job checkpointed at N processes continues at M: the same global batch, every sample of the epoch once.

One epoch of the tiny MNIST (192 images) in global batches of 12 (16 steps) is trained by a chain of
runs in one checkpoint folder: 2 processes for steps 1-5, then 3 for steps 6-11, then 2 for 12-16.
The first two are stopped by SIGTERM after their last step (all ranks save and exit). Every rank
records the indices its sampler gave it, and its weights and AdamW state before its first step
(tests/crash.py record-samples, record-loaded). Across the two changes (2 -> 3, 3 -> 2) the 16
global batches are the epoch's one shuffle cut into slices of 12, so every image is trained on
exactly once, and each rank starts from the checkpoint's state exactly. The negative control counts
the cursor per rank, as if each rank had saved its own samples. (Every pair of world sizes, 4 -> 1
among them, is checked on the sampler alone in tests/test_samplers.py; a launch costs seconds.)
The FSDP2 script's sharded checkpoints (dcp.load reshards them) and BERT's schedule and loss scaler
at another world size are checked on tests/test_resume.py's runs, which they reuse.
"""
import shutil

import pytest
import torch
from conftest import TORCHRUN, assert_ran, run_as_user
from test_resume import CRASH, RESTARTABLE, RESUME, bitwise_equal, same_state

from common.checkpoint import reseed

BATCH, IMAGES = 12, 192
CHAIN = [(2, 5), (3, 11), (2, 16)]  # (processes, the step it stops after); 16 steps in the epoch


def run(folder, data, processes, what="none", record=None, script="mnist_3_ddp_resume.py"):
    """One epoch in global batches of 12; checkpoints only on a signal and at the end."""
    return run_as_user(*TORCHRUN, f"--nproc_per_node={processes}", "--max-restarts=0", CRASH, what,
                       RESUME / script, "--data-dir", data, "--batch-size", BATCH, "--epochs", "1",
                       "--checkpoint-dir", folder, "--checkpoint-every", "1000", "--precision", "fp32",
                       "--dist-timeout", "60", timeout=240,
                       env_extra={**RESTARTABLE, **({"RECORD_SAMPLES": str(record)} if record else {})})


def recorded_batches(record, processes) -> list[set]:
    """The global batches a run trained on, in order: the j-th batch of every rank together."""
    per_rank = BATCH // processes
    ranks = [[int(line) for line in (record / f"rank{rank}.txt").read_text().split()] for rank in range(processes)]
    assert len({len(indices) for indices in ranks}) == 1  # the same number of samples on every rank
    return [{index for indices in ranks for index in indices[start:start + per_rank]}
            for start in range(0, len(ranks[0]), per_rank)]


def the_epochs_shuffle() -> list[set]:
    """DistributedSampler's shuffle of epoch 0 with seed 0, the same at every world size, cut into global batches."""
    order = torch.randperm(IMAGES, generator=torch.Generator().manual_seed(0)).tolist()
    return [set(order[start:start + BATCH]) for start in range(0, IMAGES, BATCH)]


@pytest.fixture(scope="module")
def chain(tiny_mnist, tmp_path_factory):
    """A copy of the checkpoint each run of the chain ended with, the batches each run trained on, and the
    folder where each run's ranks recorded them, and their state before their first step."""
    folder, kept = tmp_path_factory.mktemp("chain"), tmp_path_factory.mktemp("kept")
    batches, records, step, before = [], [], 0, None
    for processes, stop in CHAIN:
        record = tmp_path_factory.mktemp(f"samples-at-{processes}")
        last = stop == CHAIN[-1][1]
        result = run(folder, tiny_mnist, processes, "record-samples,record-loaded" if last else
                     f"record-samples,record-loaded,term-rank0-after-step{stop - step}", record)
        if last:
            assert_ran(result, "over 101 images")
        else:
            assert f"stopped by SIGTERM at step {stop}, after saving a checkpoint" in result.stdout, result.stderr[-3000:]
        if step:
            assert f"resumed from {folder}/step-{step:08d}.pt: epoch 0, {step * BATCH} samples into it" in result.stdout
            assert f"written by {before} processes, continued by {processes}: the same global batch" in result.stdout
        shutil.copy(folder / f"step-{stop:08d}.pt", kept)
        batches.append(recorded_batches(record, processes))
        records.append(record)
        step, before = stop, processes
    return kept, batches, records


def test_every_sample_of_the_epoch_once_across_changes_of_world_size(chain):
    """2 -> 3 -> 2 processes: the global batches are the epoch's shuffle in slices of 12, as one
    process would have trained on them, and so every image once."""
    _, batches, _ = chain
    assert [len(run_batches) for run_batches in batches] == [5, 6, 5]
    assert [batch for run_batches in batches for batch in run_batches] == the_epochs_shuffle()


def test_a_cursor_counted_per_rank_loses_or_repeats_samples(chain, tiny_mnist, tmp_path):
    """Negative control: the chain's first checkpoint (2 processes, step 5) resumed at 1 process that
    skips what one rank of 2 had done (30 samples) instead of all 60: it trains on 30 images again."""
    kept, batches, _ = chain
    folder, record = tmp_path / "folder", tmp_path / "record"
    folder.mkdir(), record.mkdir()
    shutil.copy(kept / "step-00000005.pt", folder)
    assert_ran(run(folder, tiny_mnist, 1, "record-samples,per-rank-cursor-from2", record), "over 101 images")
    trained = [index for run_batches in (batches[0], recorded_batches(record, 1)) for batch in run_batches
               for index in batch]
    assert len(trained) == IMAGES + 30 and sorted(set(trained)) == list(range(IMAGES))


def test_weights_and_optimizer_state_carry_over_exactly(chain):
    """After each change of world size (2 -> 3, 3 -> 2), every rank of the new run holds, before
    its first step, the weights and AdamW state (moments, step, hyper-parameters) of the checkpoint."""
    kept, _, records = chain
    for (processes, _), (_, resumed_at), record in zip(CHAIN[1:], CHAIN, records[1:]):
        checkpoint = torch.load(kept / f"step-{resumed_at:08d}.pt", weights_only=True)
        for rank in range(processes):
            loaded = torch.load(record / f"loaded-rank{rank}.pt", weights_only=True)
            assert bitwise_equal(loaded["parameters"], list(checkpoint["model"].values()))
            assert same_state(loaded["optimizer"], checkpoint["optimizer"])


def test_a_new_world_size_reseeds_each_rank_from_seed_rank_and_step():
    """The saved random states cannot follow the samples to other ranks; the new ones are a function of
    (seed, rank, step): the same resume draws the same dropout masks, and no two ranks draw the same."""
    def draws(rank, step=12):
        reseed(0, rank, step)
        return torch.rand(4)
    assert torch.equal(draws(1), draws(1))
    assert not torch.equal(draws(0), draws(1)) and not torch.equal(draws(1), draws(1, step=16))
