"""Uneven inputs, as benchmarks/uneven_inputs.py shows them: rank 0 has one batch more than rank 1.

Plain DDP waits in rank 0's extra all-reduce until the process group's timeout and says why; Join
lets both ranks finish with equal replicas; Accelerate's join_uneven_inputs does nothing with CPU
processes (it enables Join on GPUs only), so there it ends like plain DDP.
"""
from conftest import PYTHON, ROOT, assert_ran, run_as_user


def test_plain_ddp_hangs_until_the_timeout_and_join_finishes():
    result = run_as_user(PYTHON, ROOT / "benchmarks" / "uneven_inputs.py", "--timeout", "5", timeout=180)
    assert_ran(result, "rank 0: 5 batches, the others: 4")
    rows = {line[:32].strip(): line[32:] for line in result.stdout.splitlines()}
    hang = "None            rank 0 was stuck in the all-reduce of its batch 5, which the other ranks, out of batches after 4"
    for how in ("plain DDP", "accelerate join_uneven_inputs"):  # CPU processes: Accelerate leaves Join off
        assert hang in rows[how] and "until a timeout ended it (5 s here" in rows[how], rows[how]
        assert float(rows[how].split()[0]) >= 5  # it did wait for the timeout
    assert rows["Join"].split()[1:] == ["True", "finished"]
    assert "Joining uneven inputs is only supported for multi-GPU training" in result.stderr
