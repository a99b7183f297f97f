"""A killed run that comes back ends bitwise equal to one that was never killed.

Every run trains the tiny MNIST for 2 epochs on 3 gloo processes (6 steps per epoch, a checkpoint
every 4), with 2 DataLoader workers per process that shift the images at random (--augment), under
torchrun; tests/crash.py SIGTERMs or SIGKILLs a worker at a chosen point of a chosen attempt,
torchrun restarts the workers, and they resume from the newest checkpoint (their DataLoader
workers start afresh, mid-epoch: tests/test_augment.py shows the trap that common/augment.py avoids).
Three processes, not two: with two, every all-reduce sum is a + b == b + a, and a resumed DDP that
reduces in other buckets than the run it continues (common/resume_buckets.py) ends bitwise equal all the
same; with three it does not. A clean resume (a run's step-8 checkpoint copied into a new folder)
is checked at 2 processes too.
Equal means torch.equal on every tensor of the final weights and of the final optimizer state. The
negative controls break one part of the resume (random state, data position, the buckets) and must differ.
The FSDP2 script saves sharded checkpoints (a folder per step, every rank's pieces): its newest one
is read back whole, without a process group, through dcp_to_torch_save.
"""
import shutil

import pytest
import torch
from conftest import ROOT, TORCHRUN, assert_ran, run_as_user
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.checkpoint import checkpoints_in
from common.sharded_checkpoint import ShardedCheckpoints

CRASH = ROOT / "tests" / "crash.py"
RESUME = ROOT / "src" / "ch4" / "resume"
# the fix for torchrun restarts (see common.distributed.stale_store_hint), as the README says to launch
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# 2 DataLoader workers per rank, each shifting the images at random: a resumed run's workers start afresh mid-epoch
AUGMENTED = ["--num-workers", "2", "--augment", "2"]


def run(folder, data, what="none", processes=3, *flags, restarts=1, script="mnist_3_ddp_resume.py", record=None):
    """2 epochs of 6 steps (MNIST: 192 images; a global batch of 33 at 1 and 3 processes, 6 batches of
    11 in a rank's 64; 32 at 2 and 4), a checkpoint every 4 steps; BERT: 2 epochs of 10 steps."""
    batch = "32" if processes in (2, 4) else "33"
    data_flags = ["--data-dir", data, "--batch-size", batch, *AUGMENTED] if script.startswith("mnist") \
        else ["--model", data[0], "--dataset", data[1], "--batch-size", "12"]
    return run_as_user(*TORCHRUN, f"--nproc_per_node={processes}", f"--max-restarts={restarts}", CRASH, what,
                       RESUME / script, *data_flags, "--checkpoint-dir", folder, "--checkpoint-every", "4", "--epochs", "2",
                       "--precision", "fp32", "--dist-timeout", "60", *flags, timeout=240,
                       env_extra={**RESTARTABLE, **({"RECORD_SAMPLES": str(record)} if record else {})})


def final_state(folder):
    newest = max(folder.glob("step-*.pt"))
    checkpoint = torch.load(newest, weights_only=True)
    weights = torch.load(folder / "final.pt", weights_only=True)
    optimizer = [tensor for state in checkpoint["optimizer"]["state"].values() for tensor in state.values()]
    return [*weights.values(), *checkpoint["model"].values(), *optimizer]


def tensors_in(tree) -> list:
    """Every tensor of a nested dict or list, in a fixed order (sorted keys)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [tensor for key in sorted(tree, key=str) for tensor in tensors_in(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [tensor for item in tree for tensor in tensors_in(item)]
    return []


def sharded_final_state(folder):
    """final.pt, and the newest sharded checkpoint put back together: every tensor of the model and AdamW."""
    whole = folder.with_name(folder.name + "-whole.pt")  # beside the checkpoint folder, not in it
    dcp_to_torch_save(checkpoints_in(folder, ShardedCheckpoints.NAME)[0], whole)
    checkpoint = torch.load(whole, weights_only=True)
    weights = torch.load(folder / "final.pt", weights_only=True)
    assert sorted(checkpoint["optimizer"]["state"]) == sorted(weights)  # each parameter's moments and step
    return [*weights.values(), *tensors_in(checkpoint["model"]), *tensors_in(checkpoint["optimizer"])]


def bitwise_equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_state(a, b) -> bool:
    """Every tensor bitwise equal and every other value equal, in nested dicts and lists."""
    def without_tensors(tree):
        if isinstance(tree, dict):
            return {key: without_tensors(value) for key, value in tree.items()}
        if isinstance(tree, (list, tuple)):
            return [without_tensors(item) for item in tree]
        return None if isinstance(tree, torch.Tensor) else tree
    return bitwise_equal(tensors_in(a), tensors_in(b)) and without_tensors(a) == without_tensors(b)


def files_in(folder) -> dict:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def refused_and_untouched(folder, phrase, *run_args, **run_kwargs):
    """Run on a copied folder of checkpoints that must be refused: a non-zero exit with the phrase on
    stderr, no worker traceback (torchrun's own summary aside), and every file as it was."""
    before = files_in(folder)
    result = run(folder, *run_args, restarts=0, **run_kwargs)
    assert result.returncode != 0 and phrase in result.stderr, result.stderr[-3000:]
    assert "]: Traceback" not in result.stderr, result.stderr[-3000:]
    assert files_in(folder) == before  # nothing lost
    return result


@pytest.fixture(scope="module")
def uninterrupted(tiny_mnist, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert_ran(run(folder, tiny_mnist), "over 101 images", f"final weights in {folder / 'final.pt'}")
    return folder


# One launch, stopped three ways in a row (tests/crash.py's ITEM@N acts on torchrun's attempt N alone)
STOPPED_THREE_WAYS = ",".join([
    "termgroup-rank0-after-step6",  # rank 0's process group, its 2 DataLoader workers with it, as torchrun and SLURM send it
    "kill-rank0-in-save1@1",  # the resumed run's first save, at step 8, never lands
    "kill-rank1-after-step3@2",  # mid-epoch, no warning: after step 9, the step-8 file saved this time
])


def test_a_run_stopped_three_ways_resumes_bitwise(uninterrupted, tiny_mnist, tmp_path):
    result = run(tmp_path, tiny_mnist, STOPPED_THREE_WAYS, restarts=3)
    # the signal: both ranks stopped at the step after it, saved, and exited as if killed by it; torchrun
    # counts that as a failure (143 = 128 + SIGTERM), and restarts them
    assert_ran(result, "stopped by SIGTERM at step 6, after saving a checkpoint", "over 101 images")
    assert "failed (exitcode: 143)" in result.stderr
    # the kill in the save: its temporary file is passed over, and the run resumes from the one before
    assert result.stdout.count(f"resumed from {tmp_path}/step-00000006.pt: epoch 1, 0 samples into it, step 6") == 2
    assert "ignoring" in result.stderr and "step-00000008.pt.tmp, left by a save that did not finish" in result.stderr
    # the kill mid-epoch
    assert f"resumed from {tmp_path}/step-00000008.pt: epoch 1, 66 samples into it, step 8" in result.stdout
    assert bitwise_equal(final_state(tmp_path), final_state(uninterrupted))
    assert sorted(path.name for path in tmp_path.glob("step-*.pt")) == ["step-00000008.pt", "step-00000012.pt"]


@pytest.mark.parametrize("broken", ["forget-rng", "replay-epoch", "first-buckets"])
def test_resume_without_random_state_data_position_or_buckets_differs(uninterrupted, tiny_mnist, tmp_path, broken):
    """Negative controls: the test above can fail. Without the random state the resumed ranks draw other
    dropout masks; replaying the epoch from its start trains twice on two batches; without
    rebuild_buckets the first resumed step reduces in one bucket, where the uninterrupted run used two.
    Each resumes from the step-8 checkpoint, as the killed run above does, copied alone into a new folder."""
    shutil.copy(uninterrupted / "step-00000008.pt", tmp_path)
    assert_ran(run(tmp_path, tiny_mnist, broken, restarts=0), f"resumed from {tmp_path}/step-00000008.pt")
    assert not bitwise_equal(final_state(tmp_path), final_state(uninterrupted))


def test_clean_resume_is_bitwise_at_2_processes(tiny_mnist, tmp_path):
    """A finished run's step-8 checkpoint, alone in a new folder: the rerun ends where the run ended."""
    finished, resumed = tmp_path / "finished", tmp_path / "resumed"
    assert_ran(run(finished, tiny_mnist, "none", 2, restarts=0), "over 101 images")
    resumed.mkdir()
    shutil.copy(finished / "step-00000008.pt", resumed)
    assert_ran(run(resumed, tiny_mnist, "none", 2, restarts=0), f"resumed from {resumed}/step-00000008.pt")
    assert bitwise_equal(final_state(resumed), final_state(finished))


def test_truncated_checkpoint_falls_back_to_the_one_before(uninterrupted, tiny_mnist, tmp_path):
    """A finished run's newest checkpoint is cut short: the rerun resumes from the one before, redoes
    the last 4 steps, and still ends where the uninterrupted run ended."""
    folder = shutil.copytree(uninterrupted, tmp_path / "copy")
    newest = folder / "step-00000012.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    result = run(folder, tiny_mnist)
    assert_ran(result, f"resumed from {folder}/step-00000008.pt")
    assert f"skipping {newest}: it does not load" in result.stderr
    assert bitwise_equal(final_state(folder), final_state(uninterrupted))


@pytest.mark.parametrize("processes, flags, phrase", [
    (1, ["--seed", "1"], "belongs to another run (seed 0 there, 1 here)"),  # at another world size, which resumes
    (3, ["--precision", "bf16"], "belongs to another run (precision fp32 there, bf16 here)"),  # at the same
])
def test_checkpoint_of_another_run_is_refused(uninterrupted, tiny_mnist, tmp_path, processes, flags, phrase):
    folder = shutil.copytree(uninterrupted, tmp_path / "copy")
    result = refused_and_untouched(folder, phrase, tiny_mnist, "none", processes, *flags)
    assert "start afresh with another --checkpoint-dir" in result.stderr


def test_bert_killed_run_resumes_bitwise(tiny_bert, nli_pairs, tmp_path):
    """The tiny BERT: dropout in every layer and a linear schedule; 2 epochs of 10 steps, killed after 14.
    Under bf16 autocast: its casts are nodes of the graph whose gradient order DDP records, so the resumed
    buckets are rebuilt under the same autocast. A checkpoint is also resumed at 1 process
    (resumed_at_1), and the finished run is not trained again; one of another precision is refused in
    test_checkpoint_of_another_run_is_refused."""
    data, precision = (tiny_bert, nli_pairs), ["--precision", "bf16"]
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    assert_ran(run(uninterrupted, data, "none", 3, *precision, script="ddp_resume.py"), "over 13 pairs")
    result = run(killed, data, "kill-rank1-after-step14", 3, *precision, script="ddp_resume.py")
    assert_ran(result, f"resumed from {killed}/step-00000012.pt: epoch 1, 24 samples into it, step 12", "over 13 pairs")
    assert bitwise_equal(final_state(killed), final_state(uninterrupted))
    schedule = torch.load(killed / "step-00000020.pt", weights_only=True)["scheduler"]
    assert schedule["last_epoch"] == 20 and schedule["_last_lr"] == [0.0]  # the decay went on from step 12, to its end
    resumed_at_1(uninterrupted / "step-00000016.pt", tmp_path / "at-1", data, precision)
    assert_finished(run(uninterrupted, data, "none", 3, *precision, restarts=0, script="ddp_resume.py"), uninterrupted, 20)


def resumed_at_1(checkpoint, folder, data, precision):
    """A 3-process BERT checkpoint of step 16 resumed at 1 process (the global batch of 12 divides): before
    its first step the one rank holds the checkpoint's weights and AdamW state, tensor for tensor, and the
    schedule goes on from step 16 to its end at step 20 (bf16: no loss-scaler state)."""
    folder.mkdir()
    shutil.copy(checkpoint, folder)
    assert_ran(run(folder, data, "record-loaded", 1, *precision, restarts=0, script="ddp_resume.py", record=folder),
               "written by 3 processes, continued by 1")
    written, loaded = torch.load(checkpoint, weights_only=True), torch.load(folder / "loaded-rank0.pt", weights_only=True)
    assert bitwise_equal(loaded["parameters"], list(written["model"].values()))
    assert same_state(loaded["optimizer"], written["optimizer"])
    schedule = torch.load(folder / "step-00000020.pt", weights_only=True)["scheduler"]
    assert written["scheduler"]["last_epoch"] == 16 and schedule["last_epoch"] == 20 and schedule["_last_lr"] == [0.0]


def assert_finished(result, folder, step):
    """A rerun over a finished run's checkpoint: one sentence, a clean exit, no training, nothing written."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"nothing to train: the run in {folder} ended at step {step}" in result.stdout, result.stdout[-3000:]
    assert "train time" not in result.stdout


@pytest.fixture(scope="module")
def fsdp_uninterrupted(tiny_mnist, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp-uninterrupted")
    assert_ran(run(folder, tiny_mnist, script="mnist_fsdp_resume.py"), "over 101 images",
               f"final weights in {folder / 'final.pt'}")
    return folder


def test_fsdp_killed_run_resumes_bitwise_from_sharded_checkpoints(fsdp_uninterrupted, tiny_mnist, tmp_path):
    result = run(tmp_path, tiny_mnist, "kill-rank1-after-step10", script="mnist_fsdp_resume.py")
    assert_ran(result, f"resumed from {tmp_path}/step-00000008: epoch 1, 66 samples into it, step 8", "over 101 images")
    assert sorted(path.name for path in tmp_path.glob("step-*")) == ["step-00000008", "step-00000012"]
    for folder in tmp_path.glob("step-*"):  # one file of pieces per rank, the index, and rank 0's metadata
        assert sorted(path.name for path in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                  "__2_0.distcp", "meta.pt"]
    assert bitwise_equal(sharded_final_state(tmp_path), sharded_final_state(fsdp_uninterrupted))


@pytest.mark.parametrize("script", ["mnist_3_ddp_resume.py", "mnist_fsdp_resume.py"])
def test_a_world_size_the_global_batch_does_not_divide_over_is_refused(uninterrupted, fsdp_uninterrupted, tiny_mnist,
                                                                        tmp_path, script):
    """A checkpoint of global batch 33 resumed at 2 processes: another world size resumes (tests/test_reshard.py),
    but only with the same global batch, and 33 does not split over 2."""
    written = uninterrupted if script.startswith("mnist_3") else fsdp_uninterrupted
    folder = shutil.copytree(written, tmp_path / "copy")
    result = refused_and_untouched(folder, "--batch-size 33 is the global batch and must divide evenly over 2 processes",
                                   tiny_mnist, "none", 2, "--batch-size", "33", script=script)
    assert "a number of processes that divides 33" in result.stderr


def test_fsdp_sharded_checkpoint_reshards_from_3_processes_to_1(fsdp_uninterrupted, tiny_mnist, tmp_path):
    """The 3-process run's sharded checkpoint of step 8, resumed at 1 process (the global batch of 33 divides
    over 1): dcp.load reads the pieces of all 3 files into the one rank, which holds before its first step
    the whole model and AdamW state (both moments and the step of every parameter), tensor for tensor, and
    saves its next checkpoint in one piece."""
    folder = tmp_path / "at-1"
    shutil.copytree(fsdp_uninterrupted / "step-00000008", folder / "step-00000008")
    assert_ran(run(folder, tiny_mnist, "record-loaded", 1, restarts=0, script="mnist_fsdp_resume.py", record=folder),
               f"resumed from {folder}/step-00000008: epoch 1, 66 samples into it, step 8", "continued by 1")
    assert sorted(path.name for path in (folder / "step-00000012").glob("*.distcp")) == ["__0_0.distcp"]
    whole = tmp_path / "step-8.pt"
    dcp_to_torch_save(fsdp_uninterrupted / "step-00000008", whole)
    written, loaded = torch.load(whole, weights_only=True), torch.load(folder / "loaded-rank0.pt", weights_only=True)
    names = list(written["model"])  # the parameters' names, in the optimizer's order
    assert bitwise_equal(loaded["parameters"], [written["model"][name] for name in names])
    assert all(same_state(loaded["optimizer"]["state"][index], written["optimizer"]["state"][name])
               for index, name in enumerate(names))


@pytest.mark.parametrize("script", ["mnist_3_ddp_resume.py", "mnist_fsdp_resume.py"])
def test_a_rerun_of_a_finished_run_trains_nothing_and_says_so(uninterrupted, fsdp_uninterrupted, tiny_mnist, tmp_path,
                                                              script):
    folder = shutil.copytree(uninterrupted if script.startswith("mnist_3") else fsdp_uninterrupted, tmp_path / "copy")
    before = files_in(folder)
    result = run(folder, tiny_mnist, "none", 3, restarts=0, script=script)
    assert_finished(result, folder, 12)
    assert "pass a larger --epochs to train on" in result.stdout and files_in(folder) == before


def test_fsdp_checkpoint_of_another_precision_is_refused_before_its_shards_load(fsdp_uninterrupted, tiny_mnist, tmp_path):
    """A bf16 run's sharded checkpoint resumed in fp32, the other way round from the DDP rungs' tests. On
    the CPU the two runs' checkpoints differ in the fingerprint only (neither has a loss-scaler state), so
    rewriting meta.pt stands in for a bf16 run. Refused by the fingerprint, not by dcp.load, whose failure
    (an fp16 run finds no scaler.scale) would blame the folder."""
    folder = shutil.copytree(fsdp_uninterrupted, tmp_path / "copy")
    for meta in folder.glob("step-*/meta.pt"):
        metadata = torch.load(meta, weights_only=True)
        torch.save({**metadata, "fingerprint": {**metadata["fingerprint"], "precision": "bf16"}}, meta)
    refused_and_untouched(folder, "step-00000012 belongs to another run (precision bf16 there, fp32 here)", tiny_mnist,
                          "none", 3, script="mnist_fsdp_resume.py")


def test_truncated_shard_falls_back_to_the_checkpoint_before(fsdp_uninterrupted, tmp_path, capsys):
    """A shard file cut short (a node died while the filesystem flushed it) is not a checkpoint: rank 0
    skips the folder, with a warning, and picks the one before. No process group: rank 0's choice alone."""
    folder = shutil.copytree(fsdp_uninterrupted, tmp_path / "copy")
    shard = folder / "step-00000012" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    checkpoints = ShardedCheckpoints(folder, 4, fingerprint={}, device=torch.device("cpu"))
    metadata, name = checkpoints._newest_that_loads()
    assert name == "step-00000008" and metadata["position"]["step"] == 8
    assert f"skipping {folder / 'step-00000012'}: it does not load (EOFError)" in capsys.readouterr().err
