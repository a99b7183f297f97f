"""The debugging chapter: common/diagnose.py's two tools, and the gallery of planted bugs in src/ch4/debugging/.

Each planted bug runs in real processes with short timeouts, and the test reads the diagnosis: the
right rank, and the right operation, tensor or function. Each fixed twin runs clean.
"""
import json
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from conftest import TORCHRUN, TORCHRUN_FRESH, assert_ran, run_as_user
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.nn.parallel import DistributedDataParallel as DDP

from common.diagnose import ReplicaMismatch, check_replicas, dump_stacks_on_hang
from common.spawn import run_in_process_group


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def mismatch(module) -> str | None:
    try:
        check_replicas(module)
    except ReplicaMismatch as error:
        return str(error)
    return None


def stuck_in_data_loading(seconds):
    time.sleep(seconds)


def dumped(seconds, block) -> str:
    with tempfile.TemporaryFile("w+") as out:  # faulthandler writes to a file descriptor
        with dump_stacks_on_hang(seconds, file=out):
            block()
        out.seek(0)
        return out.read()


def diagnose_on_every_rank(rank, world_size):
    """Each tool on a real group: silent when all is well, and what it says when one rank differs."""
    said = {"equal": mismatch(make_model()), "equal, wrapped": mismatch(DDP(make_model()))}
    model = DDP(make_model())
    with torch.no_grad():
        if rank > 0:  # one ulp, on ranks 1 and 2
            weight = model.module[2].weight
            weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    said["weight on ranks 1, 2"] = mismatch(model)
    model = make_model()
    if rank == 2:
        model(torch.randn(8, 4))  # a forward in train mode updates BatchNorm's running statistics
    said["buffer on rank 2"] = mismatch(model)
    said["hang on rank 1"] = dumped(0.5, lambda: stuck_in_data_loading(2 if rank == 1 else 0))
    said["no hang"] = dumped(5, lambda: None)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, said)
    return everyone


@pytest.fixture(scope="module")
def diagnoses():
    return run_in_process_group(diagnose_on_every_rank, 3, timeout=120)


def named_ranks(message: str) -> set[int]:
    """The ranks a ReplicaMismatch names: "... on rank 1, 2 differs ..." -> {1, 2}."""
    return {int(r) for r in re.search(r" on rank ([\d, ]+) differs", message).group(1).split(",")}


def test_check_replicas_is_silent_when_replicas_agree(diagnoses):
    for said in diagnoses:
        assert said["equal"] is None and said["equal, wrapped"] is None


def test_check_replicas_names_the_tensor_and_the_ranks(diagnoses):
    for said in diagnoses:  # every rank raises the same error, so none is left waiting
        assert said["weight on ranks 1, 2"].startswith("replicas differ: 2.weight on rank 1, 2 differs")
        assert named_ranks(said["weight on ranks 1, 2"]) == {1, 2}
        assert said["buffer on rank 2"].startswith("replicas differ: 1.running_mean on rank 2 differs")
        assert "(3 of 9 parameters and buffers differ)" in said["buffer on rank 2"]  # mean, var, count
        assert named_ranks(said["buffer on rank 2"]) == {2}


def test_named_ranks_rejects_the_wrong_rank():
    """Negative control: the rank check above fails on a message that names the wrong rank."""
    assert named_ranks("replicas differ: 1.running_mean on rank 1 differs from rank 0's copy") != {2}
    assert named_ranks("replicas differ: 2.weight on rank 1 differs from rank 0's copy") != {1, 2}


def test_dump_stacks_on_hang_names_the_rank_and_the_stuck_function(diagnoses):
    stuck = diagnoses[1]["hang on rank 1"]
    assert stuck.startswith("[rank 1] still inside the block after 0.5 s")
    assert re.search(r'line \d+ in stuck_in_data_loading\n.*line \d+ in <lambda>\n.*line \d+ in dumped', stuck), stuck
    for rank in (0, 2):  # finished within the time: nothing
        assert diagnoses[rank]["hang on rank 1"] == ""


def test_dump_stacks_on_hang_is_silent_when_the_block_finishes(diagnoses):
    assert all(said["no hang"] == "" for said in diagnoses)


# The gallery: each planted bug once, each fixed twin once, as a user launches them.

def gallery(name, *flags, processes=2, debug=None, monitor=0.1, launcher=TORCHRUN):
    """Launch a gallery program with torchrun; monitor: how often torchrun checks its workers (when one
    fails it stops the others at the next check: a longer interval lets every rank print its error).
    The runs that read torchrun's summary of a failed rank use torchrun itself (TORCHRUN_FRESH)."""
    env = {"OMP_NUM_THREADS": "1", **({"TORCH_DISTRIBUTED_DEBUG": debug} if debug else {})}
    return run_as_user(*launcher, f"--nproc_per_node={processes}", f"--monitor-interval={monitor}",
                       f"src/ch4/debugging/{name}.py", *flags, timeout=120, env_extra=env)


def failures(stderr: str) -> tuple[dict, dict]:
    """torchrun's summary of a failed run: the root-cause block and every block by rank, each block as its
    time, rank, exit code and traceback."""
    summary = stderr.split("Failures:")[-1]
    others, cause = summary.split("Root Cause (first observed failure):")
    def blocks(text):
        return {int(b["rank"]): b for b in (m.groupdict() for m in re.finditer(
            r"time\s+: (?P<time>\S+)\n.*?rank\s+: (?P<rank>\d+).*?exitcode\s+: (?P<exitcode>-?\d+)"
            r".*?traceback : (?P<traceback>.*?)(?=\n-{20}|\n={20}|\n\[\d+\]:|\Z)", text, re.S))}
    root, = blocks(cause).values()
    return root, blocks(others) | {int(root["rank"]): root}


def assert_root_cause_is(rank: int, stderr: str):
    """torchrun names the failure with the earliest time in whole seconds, and a tie goes to the lowest
    rank among those it found ended at one look (it adds the ranks it stops itself after those), so a
    consequence that ends by itself in the same second as its cause is named in its place. The cause exits 1,
    or -6 where its interpreter aborts as it shuts down after the exception (seen once in a full suite)."""
    root, every = failures(stderr)
    cause = every[rank]
    assert cause["exitcode"] in ("1", "-6"), cause
    if int(root["rank"]) != rank:  # only a tie may put another rank first: a lower one, ended by itself
        tie = root["time"] == cause["time"] and int(root["rank"]) < rank and root["exitcode"] != "-15"
        assert tie, stderr[-3000:]
    return cause


@pytest.mark.parametrize("first, then, named_rank_1", [
    ((1, 1, 100.2), (0, -6, 100.7), True),    # rank 1 first: named
    ((1, 1, 100.2), (0, -15, 100.3), True),   # a tie with the rank torchrun stopped: rank 1 still named
    ((0, -6, 100.3), (1, 1, 100.2), True),    # a tie with rank 0, ended by itself: rank 0 named, allowed
    ((0, -6, 99.9), (1, 1, 100.2), False),    # rank 0 a second earlier: the check fails
    ((0, -15, 100.3), (1, 1, 100.2), False),  # a stopped rank 0 named first: the check fails
    ((1, -6, 100.2), (0, -15, 100.3), True),  # rank 1 aborted as it shut down after its exception: named
    ((1, -15, 100.2), (0, -6, 100.3), False),  # rank 1 stopped by torchrun, not the cause: the check fails
])
def test_the_root_cause_check_allows_only_torchruns_tie(first, then, named_rank_1):
    """The summaries are torch's own (ChildFailedError), for failures in the order torchrun finds them."""
    found = {}
    for rank, exitcode, seconds in (first, then):
        found[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="")
        found[rank].timestamp = int(seconds)
    stderr = str(ChildFailedError("worker.py", found))
    if named_rank_1:
        assert_root_cause_is(1, stderr)
    else:
        with pytest.raises(AssertionError):
            assert_root_cause_is(1, stderr)


def stack_of(stderr: str, rank: int) -> str:
    """The stacks dump_stacks_on_hang printed for one rank (up to the next rank's header)."""
    return re.search(rf"\[rank {rank}\] still inside the block.*?(?=\[rank \d\] still inside|\Z)", stderr, re.S).group(0)


@pytest.mark.parametrize("name, debug, printed", [  # the others: tests/test_as_users_run.py, as their pages launch them
    ("rank0_collective", "DETAIL", "epoch 3: accuracy"),
    ("shape_mismatch", "DETAIL", "gathered 101 predictions"),
    ("unused_parameter", "INFO", "trained 4 steps"),
])
def test_each_fixed_twin_runs_clean_under_the_debug_level_that_names_its_bug(name, debug, printed):
    result = gallery(name, "--fixed", debug=debug)
    assert_ran(result, printed)
    assert "still inside the block" not in result.stderr  # the watchdog stayed quiet


def test_a_collective_on_rank_0_only_is_named_by_the_fingerprint_check():
    result = gallery("rank0_collective", debug="DETAIL", monitor=1)  # both ranks print their side
    assert result.returncode != 0
    assert re.search(r"Rank 0 is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, OpType=ALLREDUCE, "
                     r"TensorShape=\[\], TensorDtypes=Float", result.stderr), result.stderr[-3000:]
    assert re.search(r"Rank 1 is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, OpType=ALLREDUCE, "
                     r"TensorShape=\[2\], TensorDtypes=Double", result.stderr), result.stderr[-3000:]
    assert "[rank0]:   File" in result.stderr and ", in average\n" in result.stderr  # rank 0's traceback: the helper


def test_a_shape_mismatch_is_named_by_the_fingerprint_check():
    result = gallery("shape_mismatch", debug="DETAIL", monitor=1)  # both ranks print their side
    assert result.returncode != 0
    for rank, shape in ((0, 51), (1, 50)):
        assert re.search(rf"Rank {rank} is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                         rf"OpType=ALLGATHER, TensorShape=\[{shape}\]", result.stderr), result.stderr[-3000:]


def test_a_rank_stuck_outside_a_collective_is_found_by_its_stacks():
    result = gallery("stuck_outside")
    assert result.returncode != 0
    stuck, waiting = stack_of(result.stderr, 1), stack_of(result.stderr, 0)
    assert stuck.startswith("[rank 1] still inside the block after 5 s")
    assert re.search(r"stuck_outside.py\", line \d+ in wait_for\n", stuck), stuck
    assert "in wait_for" not in waiting, waiting  # rank 0 is elsewhere: a swapped header would fail here
    assert "Timed out waiting 10000ms" in result.stderr  # then the group's timeout ends it


def test_a_dead_rank_is_the_root_cause_in_torchruns_summary():
    result = gallery("dead_rank", launcher=TORCHRUN_FRESH)
    assert result.returncode != 0
    cause = assert_root_cause_is(1, result.stderr)
    assert "ValueError: rank 1: batch 2 holds a non-finite input" in cause["traceback"], cause  # @record's


def test_an_unused_parameter_is_named_with_its_rank():
    result = gallery("unused_parameter", debug="INFO", launcher=TORCHRUN_FRESH)
    assert result.returncode != 0
    assert "Parameters which did not receive grad for rank 1: aux.bias, aux.weight" in result.stderr, result.stderr[-3000:]
    assert_root_cause_is(1, result.stderr)


def test_silently_wrong_bugs_show_in_what_the_program_prints():
    result = gallery("silently_wrong")
    assert_ran(result)  # exit code 0: nothing fails
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines["set_epoch"].endswith("the same order again")
    assert lines["drift"].startswith("replicas differ: weight on rank 1 differs")
    assert lines["batchnorm"].startswith("replicas differ: 1.running_mean on rank 1 differs")
    norms = json.loads(lines["clip"].removeprefix("the ranks clip by the norms "))
    assert norms[0] != norms[1]
    assert lines["metric"].endswith("/51 test examples")  # rank 0's share of 101
    assert "2 ranks step 0.50 times as far" in lines["loss_sum"]
