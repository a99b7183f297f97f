"""The data-pipeline chapter (src/ch4/data_pipeline/): workers that augment from generators of their own, and
runs that resume exactly with them.

Launched runs train the tiny MNIST (192 images) for 2 epochs of 6 steps, global batch 36, on 3 gloo processes
with 2 DataLoader workers each that shift the images at random (--augment 2), a checkpoint every 2 steps.
A run (one torchrun launch, --max-restarts=2) is SIGKILLed twice mid-epoch (rank 1 after step 3; rank 2 three steps after the resume from step 2,
with batches prefetched by the workers) and resumes twice, from step 2 and from step 4; its final weights and
optimizer state must equal, bitwise, those of the run that was never killed. Both rungs are held to the same
uninterrupted run of mnist_workers.py: a StatefulDataLoader changes how the rung resumes, not what it trains.
The traps and their fixes are shown on the loaders themselves, in this process, with forked workers.
"""
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import TORCHRUN, assert_ran, run_as_user
from process_tree import alive
from test_resume import CRASH, RESTARTABLE, bitwise_equal, final_state
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from common.loader_state import restore_loader
from common.mnist import MNISTTensors
from common.samplers import ResumableDistributedSampler
from common.stop_signal import leave_signals_to_the_rank
from common.stream import mnist_stream, shards_in, write_shards
from common.worker_seeds import WorkerShift, seed_epoch, seed_worker, warn_if_oversubscribed

PIPELINE = Path(__file__).resolve().parent.parent / "src" / "ch4" / "data_pipeline"
BATCH, IMAGES = 36, 192


def run(script, folder, data, processes=3, what="none", *flags, record=None, restarts=0, workers=2, dist_timeout=60,
        timeout=240):
    return run_as_user(*TORCHRUN, f"--nproc_per_node={processes}", f"--max-restarts={restarts}", CRASH, what,
                       PIPELINE / script, "--data-dir", data, *flags, "--batch-size", BATCH, "--num-workers", workers,
                       "--augment", "2", "--epochs", "2", "--checkpoint-every", "2", "--checkpoint-dir", folder,
                       "--precision", "fp32", "--dist-timeout", dist_timeout, timeout=timeout,
                       env_extra={**RESTARTABLE, **({"RECORD_SAMPLES": str(record)} if record else {})})


@pytest.fixture(scope="module")
def uninterrupted(tiny_mnist, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert_ran(run("mnist_workers.py", folder, tiny_mnist), "over 101 images")
    return final_state(folder)


def kill_twice(script, data, tmp_path_factory):
    """The folder of the chain (every checkpoint kept) and the samples each rank of its first attempt was given
    (recorded in order; the first 2 batches are the step-2 checkpoint's). One launch, killed on its first attempt
    and on its first restart, and restarted by torchrun each time (--max-restarts=2)."""
    folder, record = tmp_path_factory.mktemp("chain"), tmp_path_factory.mktemp("record")
    result = run(script, folder, data, what="kill-rank1-after-step3,kill-rank2-after-step3@1,record-samples@0,"
                 "keep-checkpoints", record=record, restarts=2)
    assert_ran(result, "epoch 0, 72 samples into it, step 2", "epoch 0, 144 samples into it, step 4", "over 101 images")
    assert result.stdout.count("resumed from") == 2, result.stdout
    return folder, record


@pytest.fixture(scope="module")
def workers_chain(tiny_mnist, tmp_path_factory):
    return kill_twice("mnist_workers.py", tiny_mnist, tmp_path_factory)


@pytest.fixture(scope="module")
def stateful_chain(tiny_mnist, tmp_path_factory):
    return kill_twice("mnist_stateful.py", tiny_mnist, tmp_path_factory)


@pytest.mark.parametrize("chain", ["workers_chain", "stateful_chain"])
def test_killed_twice_mid_epoch_the_run_ends_bitwise_as_if_never_stopped(uninterrupted, chain, request):
    folder, _ = request.getfixturevalue(chain)
    assert bitwise_equal(final_state(folder), uninterrupted)


def trained(record: Path, processes: int, steps: int, per_rank: int, first: int = 0) -> list[int]:
    """The indices the ranks of one run trained on in `steps` steps of `per_rank` samples (the sampler
    records what the workers were sent, prefetched batches too: the rest is cut off)."""
    return [index for rank in range(processes)
            for index in [int(line) for line in (record / f"rank{rank}.txt").read_text().split()][first:first + steps * per_rank]]


def test_another_world_size_trains_every_sample_of_the_epoch_once(stateful_chain, tiny_mnist, tmp_path):
    """3 -> 2 -> 3 processes over epoch 0: mnist_stateful.py's step-2 checkpoint of 3 ranks goes on at 2 (SIGTERM
    after 2 steps: a checkpoint at step 4), then at 3 to the end. The loader states do not fit, the run says so
    and goes on from the global cursor: the samples of epoch 0, counted by index over all ranks, are each
    trained on once (steps 1-2 at 3 ranks, 3-4 at 2, 5-6 at 3; step 6 is the epoch's last, 12 images). The stop
    at 2 is SIGTERM to rank 0's process group, its DataLoader workers with it, as torchrun and SLURM send it:
    the workers leave it to the rank, which saves."""
    chain, first = stateful_chain
    folder, at_2, at_3 = tmp_path / "folder", tmp_path / "at-2", tmp_path / "at-3"
    for made in (folder, at_2, at_3):
        made.mkdir()
    shutil.copy(chain / "step-00000002.pt", folder)
    result = run("mnist_stateful.py", folder, tiny_mnist, 2, "record-samples,termgroup-rank0-after-step2", record=at_2)
    assert "stopped by SIGTERM at step 4" in result.stdout, result.stderr[-3000:]
    assert "the loader states of 3 ranks with 2 workers each do not carry over to 2 ranks with 2" in result.stdout
    assert_ran(run("mnist_stateful.py", folder, tiny_mnist, 3, "record-samples", record=at_3),
               "do not carry over to 3 ranks", "over 101 images")
    epoch = [*trained(first, 3, 2, 12), *trained(at_2, 2, 2, 18), *trained(at_3, 3, 1, 12), *trained(at_3, 3, 1, 4, 12)]
    assert sorted(epoch) == list(range(IMAGES))


# The traps, on the loaders alone: rank 1 of 3, batches of 12, 2 workers.

class InitShift(WorkerShift):
    """The trap: a generator made in __init__ from the run's seed, copied into every worker and every rank."""

    def __init__(self, dataset, pixels, seed=0):
        super().__init__(dataset, pixels)
        self.generator.manual_seed(seed)


def shifted_batches(dataset, rank, seeded=True, loader=DataLoader, epoch=0, samples_done=0, state=None, keep=None):
    sampler = ResumableDistributedSampler(dataset, 12, num_replicas=3, rank=rank, seed=0)
    loader = loader(dataset, 12, sampler=sampler, collate_fn=dataset.collate, num_workers=2,
                    worker_init_fn=seed_worker if seeded else None, generator=torch.Generator())
    sampler.set_epoch(epoch, samples_done)
    if seeded:
        seed_epoch(loader, 0, rank, epoch)
    if state is not None:
        loader.load_state_dict(state)
    batches = []
    for images, _ in loader:
        batches.append(images)
        if keep is not None and len(batches) == keep:
            return batches, loader.state_dict()
    return batches


@pytest.fixture(scope="module")
def images(tiny_mnist):
    return MNISTTensors(Path(tiny_mnist) / "MNIST" / "raw", train=True)


def shifts(batches, unshifted):
    """Each image's shift, found back by rolling the unshifted image until it matches."""
    found = []
    for batch, plain in zip(batches, unshifted):
        for image, original in zip(batch, plain):
            found.append(next((rows, columns) for rows in range(-2, 3) for columns in range(-2, 3)
                              if torch.equal(torch.roll(original, (rows, columns), (-2, -1)), image)))
    return found


@pytest.mark.parametrize("kind, seeded, repeats", [(WorkerShift, True, False), (InitShift, False, True)])
def test_each_worker_of_each_rank_draws_its_own_shifts(images, kind, seeded, repeats):
    """Seeded per worker from the loader's per-rank, per-epoch generator, the two workers of a rank and the
    same worker of two ranks draw different shifts. The control: a generator made in __init__ (and no
    worker_init_fn) gives worker 1 worker 0's shifts, and rank 1 rank 0's."""
    plain = {rank: shifted_batches(WorkerShift(images, 0), rank, seeded=False) for rank in (0, 1)}
    drawn = {rank: shifts(shifted_batches(kind(images, 2), rank, seeded), plain[rank]) for rank in (0, 1)}
    worker_0, worker_1 = drawn[1][:12], drawn[1][12:24]  # batch 0 comes from worker 0, batch 1 from worker 1
    assert (worker_0 == worker_1) == repeats
    assert (drawn[0] == drawn[1]) == repeats
    assert len(set(drawn[1])) > 5  # and the shifts vary within a worker


@pytest.mark.parametrize("how, same", [("replay", True), ("afresh", False)])
def test_a_resumed_loader_draws_again_what_the_workers_drew_only_by_replaying(images, how, same):
    """mnist_workers.py's resume: a loader started at the epoch's first batch, whose first 2 batches are thrown
    away, gives the later batches the shifts of the loader that never stopped. The control starts the loader
    at the cursor instead, as the resume rung does for its (seed, epoch, index) shifts: other draws."""
    never_stopped = shifted_batches(WorkerShift(images, 2), 1)
    resumed = shifted_batches(WorkerShift(images, 2), 1)[2:] if how == "replay" else \
        shifted_batches(WorkerShift(images, 2), 1, samples_done=72)
    assert len(resumed) == len(never_stopped) - 2
    assert all(torch.equal(a, b) for a, b in zip(resumed, never_stopped[2:])) == same


@pytest.mark.parametrize("restored, same", [(True, True), (False, False)])
def test_a_stateful_loader_restored_mid_epoch_goes_on_with_each_workers_generator(images, restored, same):
    """mnist_stateful.py's resume: the state taken after 3 batches (worker 0 sent 2, worker 1 one, and both
    had more prefetched) starts a new loader's workers where they were. The control, a new loader at the
    cursor without the state, draws other shifts for the same images."""
    never_stopped = shifted_batches(WorkerShift(images, 2), 1, loader=StatefulDataLoader)
    _, state = shifted_batches(WorkerShift(images, 2), 1, loader=StatefulDataLoader, keep=3)
    resumed = shifted_batches(WorkerShift(images, 2), 1, loader=StatefulDataLoader, state=state) if restored else \
        shifted_batches(WorkerShift(images, 2), 1, loader=StatefulDataLoader, samples_done=108)
    assert len(resumed) == len(never_stopped) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, never_stopped[3:])) == same


# The stream (mnist_stream.py): the tiny MNIST as 12 Parquet shards, a shuffle buffer of 8 rows per worker.

def stream_run(folder, data, shards, processes=3, what="none", workers=2, restarts=0, timeout=240):
    return run("mnist_stream.py", folder, data, processes, what, "--stream-dir", shards, "--shuffle-buffer", "8",
               restarts=restarts, workers=workers, dist_timeout=20, timeout=timeout)


@pytest.fixture(scope="module")
def unequal_shards(images, tmp_path_factory):
    """In epoch 0 rank r streams shards r, r + 3, r + 6 and r + 9: rank 0 80 rows (8 batches of at most 12), rank 1
    64 (6), rank 2 48 (4). From epoch 1 on datasets shuffles the shards' order by the epoch, the same on every
    rank: in epoch 1 ranks 0 and 1 have 6 batches, rank 2 7."""
    folder = tmp_path_factory.mktemp("shards")
    write_shards(images, folder, sizes=[20, 16, 12] * 4)
    return folder


def test_a_killed_stream_resumes_exactly_with_its_shuffle_buffers(tiny_mnist, unequal_shards, tmp_path):
    """Ranks with unequal shares end each epoch together, when one runs out: 4 steps in epoch 0, 6 in epoch 1,
    10 in all. Killed after step 3 (rank 1, its workers with rows in their buffers and batches prefetched) and
    resumed from step 2, then killed after step 5 and resumed from step 4, the epoch's last (rank 2's loader
    state: nothing left; the other ranks' rows are left unread), in one launch at 3 processes: bitwise the run
    that never stopped."""
    never, killed = tmp_path / "never", tmp_path / "killed"
    assert_ran(stream_run(never, tiny_mnist, unequal_shards), "over 101 images")
    assert max(never.glob("step-*.pt")).name == "step-00000010.pt"
    assert_ran(stream_run(killed, tiny_mnist, unequal_shards, what="kill-rank1-after-step3,kill-rank1-after-step3@1",
                          restarts=2),
               "epoch 0, 72 samples into it, step 2", f"resumed from {killed}/step-00000004.pt: epoch 0,")
    assert bitwise_equal(final_state(killed), final_state(never))


def test_a_rank_that_leaves_the_epoch_alone_stops_the_run(images, tiny_mnist, tmp_path):
    """The trap that every_rank_has closes (the test above: the run ends). Two shards of 120 and 72 rows over 2
    processes without workers: rank 1 runs out after 4 of its batches of 18, rank 0 has 7. Leaving the loop on
    rank 1 alone, its next collective (the loss's all-reduce) meets rank 0's gradient all-reduce, which gloo
    sees by their sizes and aborts on; a backend that does not compare sizes waits until the process group's
    timeout (20 s here)."""
    folder = tmp_path / "uneven"
    write_shards(images, folder, sizes=[120, 72])
    result = stream_run(tmp_path / "run", tiny_mnist, folder, processes=2, what="no-agreed-stop", workers=0, timeout=120)
    assert result.returncode != 0 and "over 101 images" not in result.stdout
    assert "collective mismatch" in result.stderr, result.stderr[-3000:]  # gloo compares the sizes: 787,380 bytes vs 8


def test_shards_that_do_not_split_over_ranks_and_workers_are_refused_in_one_sentence(unequal_shards, capsys):
    with pytest.raises(SystemExit):
        mnist_stream(unequal_shards, 0, 5, 2)
    assert "holds 12 Parquet shards, which do not split evenly over 5 ranks x 2 workers; pass a --stream-dir with a " \
           "multiple of 10 shards" in capsys.readouterr().err


def test_two_writers_at_once_show_no_shard_or_all_of_them(images, tmp_path, monkeypatch):
    """Two runs started together on the default --stream-dir each write the shards. A reader must find none or all
    12 whenever it looks (shards renamed into place one by one were found one at a time); both writers leave 12
    whole shards, and nothing of their own beside them."""
    folder, found, rename = tmp_path / "mnist_stream", [], Path.rename

    def rename_and_look(self, target):  # a reader looking just after each rename into place
        moved = rename(self, target)
        found.append(len(list(folder.glob("*.parquet"))))
        return moved
    monkeypatch.setattr(Path, "rename", rename_and_look)
    writers = [threading.Thread(target=write_shards, args=(images, folder)) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert found and set(found) == {12}, found
    assert sum(pq.read_metadata(path).num_rows for path in folder.glob("*.parquet")) == len(images)
    assert [path.name for path in tmp_path.iterdir()] == ["mnist_stream"]
    found.clear()  # the control: the same shards renamed into place one by one, as a reader finds them
    folder, written = tmp_path / "one-by-one", folder
    folder.mkdir()
    for shard in sorted(written.glob("*.parquet")):
        shard.rename(folder / shard.name)
    assert found == list(range(1, 13))


def test_a_stream_dir_of_other_files_is_refused_in_one_sentence_and_kept(images, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        shards_in(str(folder), images, local_rank=0)
    assert f"error: {folder} holds files but no Parquet shards; pass an empty or new --stream-dir" in capsys.readouterr().err
    assert [path.name for path in tmp_path.rglob("*")] == ["mine", "notes.txt"]


class Loader:
    num_workers = 2

    def load_state_dict(self, state):
        self.state = state


@pytest.mark.parametrize("cursor", [True, False])
def test_a_loader_state_of_other_ranks_is_not_loaded(cursor, capsys):
    """Map-style: said, and the run goes on from the cursor; a stream: refused, the checkpoint untouched."""
    saved = {"num_workers": 2, "ranks": [{"rank": 0}, {"rank": 1}, {"rank": 2}]}
    assert restore_loader(loader := Loader(), saved, 1, 3, cursor) and loader.state == {"rank": 1}
    if cursor:
        assert not restore_loader(Loader(), saved, 1, 2)
        assert "3 ranks with 2 workers each do not carry over to 2 ranks with 2" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit):
            restore_loader(Loader(), saved, 1, 2, cursor)
        assert "do not carry over to 2 ranks with 2; resume with --nproc_per_node=3" in capsys.readouterr().err


def test_more_workers_than_cores_per_rank_are_warned_of(capsys):
    cores = len(os.sched_getaffinity(0))
    warn_if_oversubscribed(cores, 1)
    assert capsys.readouterr().err == ""
    warn_if_oversubscribed(cores + 1, 1)
    assert f"pass --num-workers {cores} or fewer" in capsys.readouterr().err


def worker_groups(images, init) -> list[int]:
    loader = DataLoader(WorkerShift(images, 2), 12, collate_fn=images.collate, num_workers=2, worker_init_fn=init,
                        generator=torch.Generator())
    batches = iter(loader)
    next(batches), next(batches)  # one batch from each worker: both have run their worker_init_fn
    return [os.getpgid(worker.pid) for worker in batches._workers]


@pytest.mark.parametrize("init, own_group", [(seed_worker, True), (None, False)])
def test_workers_are_out_of_reach_of_a_signal_to_their_ranks_group(images, init, own_group):
    """torchrun signals a rank's whole process group. seed_worker's workers each have a group of their own, so the
    rank alone gets the SIGTERM and saves (the 3 -> 2 -> 3 test and test_resume.py's termgroup stop send it so);
    the control, workers as the DataLoader makes them, share the rank's group, die of the signal, and fail the
    rank before it saves."""
    groups = worker_groups(images, init)
    assert all((group != os.getpgid(0)) == own_group for group in groups)


def rank_with_workers(init, pids) -> None:
    """A stand-in for a rank: a loader's two workers started, their pids sent, then it waits to be killed."""
    batches = iter(DataLoader(range(40), 10, num_workers=2, worker_init_fn=init))
    next(batches), next(batches)  # one batch from each worker: both have run their worker_init_fn
    pids.send([worker.pid for worker in batches._workers])
    time.sleep(60)


def own_group_only(worker_id: int) -> None:
    os.setpgrp()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux: prctl's PR_SET_PDEATHSIG")
@pytest.mark.parametrize("init, die_with_it", [(leave_signals_to_the_rank, True), (own_group_only, False)])
def test_workers_out_of_their_ranks_group_die_the_moment_it_is_killed(init, die_with_it):
    """Out of the rank's group, a worker no longer gets torchrun's SIGKILL to the group: leave_signals_to_the_rank
    has the kernel kill it with its rank, which would otherwise wait for the rank's sockets that the worker holds.
    The control, a group of its own and nothing more, outlives the rank by a second (its DataLoader checks that
    its parent lives only every 5 s)."""
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    rank = fork.Process(target=rank_with_workers, args=(init, send))
    rank.start()
    workers = receive.recv()
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    try:
        deadline = time.monotonic() + 1
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (not any(map(alive, workers))) == die_with_it
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, signal.SIGKILL)
