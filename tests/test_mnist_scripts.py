"""Each MNIST chapter script, run end to end the way the README says, on a tiny MNIST the tests write.

The test set has 101 images, which divides by neither 2 nor 3 processes: every run must still report
an accuracy over exactly 101 images. The runs under torchrun and accelerate launch, 2 and 3 processes,
are in test_lessons.py, which also checks what they compute.
"""
import shutil

import pytest
from conftest import PYTHON, ROOT, TEST_IMAGES, TORCHRUN, assert_clear_error, assert_ran

CH4 = ROOT / "src" / "ch4"
EXACT = f"over {TEST_IMAGES} images"


def assert_ok(result):
    assert_ran(result, EXACT)


# mnist_1_single.py and mnist_2_data_parallel.py run with python in test_as_users_run.py; these two run there launched
@pytest.mark.parametrize("script", ["mnist_4_accelerate.py", "mnist_5_lightning.py"])
def test_one_process_with_python(run_command, tiny_mnist, script):
    assert_ok(run_command(PYTHON, CH4 / script, "--data-dir", tiny_mnist))


def test_classic_loader_and_two_epochs(run_command, tiny_mnist):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--data-dir", tiny_mnist, "--loader", "classic",
                         "--epochs", "2")
    assert_ok(result)
    assert "epoch 1:" in result.stdout


def test_runs_from_inside_src_ch4(run_command, tiny_mnist):
    assert_ok(run_command(PYTHON, "mnist_1_single.py", "--data-dir", tiny_mnist, cwd=CH4))


def test_a_chapter_folder_script_starts_from_inside_its_folder(run_command, folder="resume", script="mnist_3_ddp_resume.py"):
    """`common` comes from the installed package, not from the working directory: started from its own
    folder without a launcher, the script gets as far as saying how to launch it, with its path."""
    result = run_command(PYTHON, script, cwd=CH4 / folder)
    assert_clear_error(result, f"torchrun --nproc_per_node=2 src/ch4/{folder}/{script}")


# ---- bad input: one clear sentence and a non-zero exit, never a deep traceback ----

def test_global_batch_that_does_not_divide(run_command, tiny_mnist):
    result = run_command(*TORCHRUN, "--nproc_per_node=3", CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist,
                         "--batch-size", "64", "--dist-timeout", 60)
    assert result.returncode != 0
    assert "--batch-size 64 is the global batch and must divide evenly over 3 processes" in result.stderr


def test_ddp_script_without_a_launcher(run_command, tiny_mnist):
    result = run_command(PYTHON, CH4 / "mnist_3_ddp.py", "--data-dir", tiny_mnist)
    assert_clear_error(result, "needs a launcher: torchrun --nproc_per_node=2")


def test_lightning_devices_that_differ_from_torchrun(run_command, tiny_mnist):
    """Lightning would raise a ValueError inside fit(); the script stops before, with one sentence per rank."""
    result = run_command(*TORCHRUN, "--nproc_per_node=2", CH4 / "mnist_5_lightning.py", "--data-dir", tiny_mnist,
                         "--devices", "1")
    assert result.returncode != 0
    message = "error: torchrun started 2 processes, 2 per node on 1 node(s), but --devices 1 --num-nodes 1"
    assert message in result.stderr, result.stderr[-3000:]  # each rank that gets this far says it (torchrun may stop the second first)
    assert "ValueError" not in result.stderr and "[rank0]: Traceback" not in result.stderr, result.stderr[-3000:]


def test_missing_dataset_offline(run_command, tmp_path):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--data-dir", tmp_path / "nothing-here")
    assert_clear_error(result, "MNIST is not in", "pass --data-dir")


def test_a_file_that_is_not_mnist_is_one_sentence(tiny_mnist, tmp_path):
    """The idx files are read without torchvision: a file of another format, or one cut short, stops with
    what to pass."""
    from common.mnist import load_mnist
    folder = tmp_path / "copy"
    shutil.copytree(tiny_mnist, folder)
    images = folder / "MNIST" / "raw" / "train-images-idx3-ubyte"
    for broken in (b"<html>not found</html>", images.read_bytes()[:-1]):  # another format; cut short
        images.write_bytes(broken)
        with pytest.raises(SystemExit, match="is not a whole MNIST idx file of unsigned bytes; pass --data-dir"):
            load_mnist(str(folder))


def test_missing_dataset_under_torchrun(run_command, tmp_path):
    """Local rank 0 says what is missing; the rank waiting for it says why it stops, no traceback. (torchrun stops
    the other ranks at its first check after one fails: a check a second gives rank 1 the time to say it.)"""
    result = run_command(*TORCHRUN, "--nproc_per_node=2", "--monitor-interval=1", CH4 / "mnist_3_ddp.py", "--data-dir", tmp_path / "none",
                         "--dist-timeout", 60)
    assert result.returncode != 0
    assert "MNIST is not in" in result.stderr and "pass --data-dir" in result.stderr, result.stderr[-3000:]
    assert "rank 1 stopped because local rank 0 stopped while preparing the data" in result.stderr, result.stderr[-3000:]
    assert "[rank1]: Traceback" not in result.stderr, result.stderr[-3000:]


def test_unknown_flag(run_command, tiny_mnist):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--data-dir", tiny_mnist, "--bogus")
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in result.stderr


@pytest.mark.parametrize("script", ["mnist_1_single.py", "mnist_4_accelerate.py"])
def test_fp16_on_cpu(run_command, tiny_mnist, script):
    result = run_command(PYTHON, CH4 / script, "--data-dir", tiny_mnist, "--precision", "fp16")
    assert_clear_error(result, "fp16 needs a GPU (CUDA, XPU or MPS)")


def test_batch_size_must_be_positive(run_command, tiny_mnist):
    result = run_command(PYTHON, CH4 / "mnist_1_single.py", "--data-dir", tiny_mnist, "--batch-size", "0")
    assert result.returncode == 2
    assert "--batch-size: must be a positive whole number, not 0" in result.stderr
