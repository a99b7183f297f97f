"""benchmarks/reductions_side_by_side.py, the demo docs/reductions.md runs: at 2 processes, each wrong
way prints a number other than one process's, and each right way prints one process's.

The wrong and right numbers come from the functions of common/ (tests/test_reductions.py checks those
in depth); here the check is that the demo shows what its page says it shows, and the negative
control that the comparison it relies on tells the wrong numbers from the right ones.
"""
import math
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import reductions_side_by_side as demo  # noqa: E402  (after the line above)

WRONG, RIGHT = "wrong", "right"


def same(got, want) -> bool:
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


def side_by_side(measured) -> dict[str, list[tuple[str, list[float], float]]]:
    """Per quantity: (wrong or right, every rank's number, one process's number)."""
    one, ranks = measured["one_process"], measured["ranks"]
    clipping = [(WRONG if "own" in name else RIGHT, [rank["clipping"][name] for rank in ranks], one["norm"])
                for name in ranks[0]["clipping"]]
    token_loss = [(RIGHT if way == "global_tokens" else WRONG, [ranks[0]["token_loss"][way][0]], one["token_loss"])
                  for way in ranks[0]["token_loss"]]
    token_gradient = [(RIGHT if way == "global_tokens" else WRONG, [ranks[0]["token_loss"][way][1]], 0.0)
                      for way in ranks[0]["token_loss"]]
    batch_norm = [(RIGHT if name == "AllRanksBatchNorm2d" else WRONG, [rank["batch_norm"][name][0] for rank in ranks],
                   one["running_mean"]) for name in ranks[0]["batch_norm"]]
    batch_norm_output = [(RIGHT if name == "AllRanksBatchNorm2d" else WRONG,
                          [rank["batch_norm"][name][1] for rank in ranks], 0.0) for name in ranks[0]["batch_norm"]]
    printed = [(RIGHT if name == "mean over the ranks" else WRONG, [ranks[0]["printed_loss"][name]], one["loss"])
               for name in ranks[0]["printed_loss"]]
    return {"clipping": clipping, "token loss": token_loss, "token gradient": token_gradient,
            "batch norm": batch_norm, "batch norm output": batch_norm_output, "printed loss": printed}


def test_the_demo_prints_wrong_beside_right_and_the_right_equals_one_process(capsys):
    measured = demo.main(["--nproc", "2"])
    printed = capsys.readouterr().out
    assert len(measured["ranks"]) == 2
    for quantity, rows in side_by_side(measured).items():
        verdicts = [verdict for verdict, _, _ in rows]
        assert WRONG in verdicts and RIGHT in verdicts, quantity
        for verdict, numbers, one_process in rows:
            if verdict == RIGHT:
                assert all(same(number, one_process) for number in numbers), (quantity, numbers, one_process)
            else:  # the negative control: the same comparison rejects every wrong way's numbers
                assert not any(same(number, one_process) for number in numbers), (quantity, numbers, one_process)
    for line in ("wrong  ddp, own gradient", "right  zero-2, clip_grad_norm_", "right  the global token count",
                 "wrong  plain BatchNorm2d", "right  mean over the ranks"):
        assert line in printed, printed
    assert f"{measured['one_process']['norm']:.6f}" in printed  # one process's number printed beside them


def test_the_demo_says_what_it_prints(capsys):
    with pytest.raises(SystemExit) as stop:
        demo.main(["--help"])
    assert stop.value.code == 0
    assert "python benchmarks/reductions_side_by_side.py" in capsys.readouterr().out
