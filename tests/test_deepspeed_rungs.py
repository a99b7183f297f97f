"""The DeepSpeed rungs run as docs/deepspeed.md says, at 3 processes: the MNIST rung counts every test image once
(stages 0 and 3; 1 under DeepSpeed's own launcher), the BERT rung trains (stage 2), and a SIGKILLed ZeRO-3 run
resumes bitwise from the engine's checkpoint.

The resume: 2 epochs of 6 steps on the tiny MNIST under ZeRO-3, a checkpoint every 4 steps, rank 1
SIGKILLed after step 10; torchrun restarts the workers, which resume from step 8. The negative control
resumes from a copy of the step-8 checkpoint without the random state (tests/crash.py forget-rng): the
dropout masks differ, so do the weights.
"""
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import EVAL_PAIRS, PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_ran, run_as_user
from test_lessons import one_process_correct
from test_resume import bitwise_equal, tensors_in

pytest.importorskip("deepspeed", reason="DeepSpeed is the [deepspeed] extra: pip install -e '.[deepspeed]'")

SHARDED = ROOT / "src" / "ch4" / "sharded"
CRASH = ROOT / "tests" / "crash.py"


def run_rung(*flags, processes=3, launcher=TORCHRUN, crash=None, timeout=240, env_extra=None):
    script = [CRASH, crash, SHARDED / "mnist_deepspeed.py"] if crash else [SHARDED / "mnist_deepspeed.py"]
    return run_as_user(*launcher, f"--nproc_per_node={processes}", *script, *flags, "--dist-timeout", "60",
                       env_extra=env_extra, timeout=timeout)


def final_weights(folder):
    return list(torch.load(folder / "final.pt", weights_only=True).values())


@pytest.mark.parametrize("stage", [0, 3])  # the two ends; stage 1 runs under DeepSpeed's launcher below, 2 in the BERT rung
def test_the_rung_counts_every_test_image_once(request, tiny_mnist, tmp_path, stage):
    """Stage 3 reads the resumable ZeRO-3 run below (global batch 33), made once for this file's tests."""
    if stage == 3:
        folder, _, stdout = request.getfixturevalue("uninterrupted")
        assert "ZeRO stage 3, global batch 33 = 3 x 11" in stdout
    else:
        result = run_rung("--data-dir", tiny_mnist, "--batch-size", "48", "--precision", "fp32", "--zero-stage", "0",
                          "--checkpoint-dir", tmp_path)
        assert_ran(result, "ZeRO stage 0, global batch 48 = 3 x 16")
        folder, stdout = tmp_path, result.stdout
    assert f"final weights in {folder / 'final.pt'}" in stdout
    printed = round(float(re.search(rf"accuracy ([\d.]+)% over {TEST_IMAGES} images", stdout).group(1)) * TEST_IMAGES / 100)
    assert printed == one_process_correct(final_weights(folder), tiny_mnist)


def resumable(folder, data, crash="none", restarts=1):
    """2 epochs of 6 steps (192 images, global batch 33 = 3 x 11), a checkpoint every 4 steps, ZeRO-3."""
    return run_rung("--data-dir", data, "--batch-size", "33", "--epochs", "2", "--precision", "fp32", "--zero-stage", "3",
                    "--checkpoint-dir", folder, "--checkpoint-every", "4", crash=crash,
                    launcher=[*TORCHRUN, f"--max-restarts={restarts}"], env_extra={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def checkpoint_tensors(folder) -> list[torch.Tensor]:
    """final.pt, the fp32 masters of the newest checkpoint as DeepSpeed's zero_to_fp32 puts them back together,
    and every other tensor of it (every rank's file: AdamW's moments, the loss scaler). The masters' flat
    partitions themselves are left out: ZeRO-3 pads each parameter's piece to a multiple of the world size
    and never writes the padding, so it holds whatever the memory held (seen: 1e-43 in one run, -2e27 in
    the other, at the same places, every real number equal)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    newest = folder / (folder / "latest").read_text().strip()
    tensors = final_weights(folder) + list(get_fp32_state_dict_from_zero_checkpoint(str(folder)).values())
    for path in sorted(newest.glob("*.pt")):
        state = torch.load(path, weights_only=False)
        state.pop("rng", None)  # client_state: each rank's random state, not tensors of the model
        state.get("optimizer_state_dict", {}).pop("fp32_flat_groups", None)
        tensors += tensors_in(state)
    return tensors


@pytest.fixture(scope="module")
def uninterrupted(tiny_mnist, tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed-uninterrupted")
    result = resumable(folder, tiny_mnist)
    assert_ran(result, "over 101 images")
    return folder, checkpoint_tensors(folder), result.stdout


def test_a_killed_run_resumes_bitwise_from_the_engines_checkpoint(uninterrupted, tiny_mnist, tmp_path):
    result = resumable(tmp_path, tiny_mnist, "kill-rank1-after-step10")
    assert_ran(result, "resumed at step 8: epoch 1, 66 samples into it", "over 101 images")
    assert sorted(path.name for path in tmp_path.glob("step-*")) == ["step-12", "step-8"]  # resumed from step 8
    assert bitwise_equal(checkpoint_tensors(tmp_path), uninterrupted[1])


def test_a_resume_without_the_random_state_differs(uninterrupted, tiny_mnist, tmp_path):
    """The negative control: the uninterrupted run's step-8 checkpoint, alone in a new folder, resumed as the killed
    run above resumes, but without the random state (tests/crash.py forget-rng): other dropout masks, other weights."""
    shutil.copytree(uninterrupted[0] / "step-8", tmp_path / "step-8")
    (tmp_path / "latest").write_text("step-8")
    assert_ran(resumable(tmp_path, tiny_mnist, "forget-rng", restarts=0), "resumed at step 8: epoch 1, 66 samples into it",
               "over 101 images")
    resumed = checkpoint_tensors(tmp_path)
    assert len(resumed) == len(uninterrupted[1]) and not bitwise_equal(resumed, uninterrupted[1])


@pytest.mark.parametrize("processes, flags, phrase", [
    (1, [], "step-12 was written by 3 processes and this run has 1"),
    (3, ["--zero-stage", "1"], "step-12 belongs to another run (ZeRO stage 3 there, 1 here)"),  # DeepSpeed: an assertion
    (3, [], "nothing to train: the run in {folder} ended at step 12"),  # the same command again: a clean exit
])
def test_a_checkpoint_of_another_run_is_refused_and_kept(uninterrupted, tiny_mnist, tmp_path, processes, flags, phrase):
    folder = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted[0], folder)
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    result = run_rung("--data-dir", tiny_mnist, "--batch-size", "33", "--epochs", "2", "--precision", "fp32",
                      "--zero-stage", "3", "--checkpoint-dir", folder, *flags, processes=processes)
    finished = "nothing to train" in phrase
    assert (result.returncode == 0) == finished, result.stderr[-2000:]
    assert phrase.format(folder=folder) in (result.stdout if finished else result.stderr), result.stderr[-2000:]
    assert "]: Traceback" not in result.stderr and "train time" not in result.stdout  # torchrun's own summary aside
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before  # nothing lost


def test_deepspeeds_own_launcher_runs_the_rung(tiny_mnist, tmp_path):
    launcher = [str(Path(PYTHON).with_name("deepspeed")), "--num_gpus", "3"]  # on a CPU it counts NUMA nodes unless told
    result = run_as_user(*launcher, SHARDED / "mnist_deepspeed.py", "--data-dir", tiny_mnist, "--batch-size", "48",
                         "--precision", "fp32", "--zero-stage", "1", "--checkpoint-dir", tmp_path, "--dist-timeout", "60",
                         env_extra={"DS_ACCELERATOR": "cpu"}, timeout=240)  # it appends --local_rank=R, which the rung accepts
    assert_ran(result, "3 processes on cpu, fp32, ZeRO stage 1, global batch 48 = 3 x 16", f"over {TEST_IMAGES} images")


def test_the_bert_rung_trains_and_counts_every_pair_once(tiny_bert, nli_pairs):
    result = run_as_user(*TORCHRUN, "--nproc_per_node=3", SHARDED / "nli_deepspeed.py", "--model", tiny_bert, "--dataset",
                         nli_pairs, "--max-steps", "4", "--batch-size", "12", "--zero-stage", "2", "--precision", "fp32",
                         "--dist-timeout", "60", timeout=240)
    assert_ran(result, "ZeRO stage 2, global batch 12 = 3 x 4", f"over {EVAL_PAIRS} pairs")
