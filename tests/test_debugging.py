"""The debugging chapter: common/diagnose.py's two tools, and the gallery of planted bugs in src/ch4/debugging/.

Each planted bug runs in real processes with short timeouts, and the test reads the diagnosis: the
right rank, and the right operation, tensor or function. Each fixed twin runs clean.
"""
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
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
