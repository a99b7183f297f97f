"""tools/mutations.py plants each of its bugs by replacing one piece of text in one file: a bug whose text is
no longer in its file (the code moved on) would never be planted, and the table would prove nothing about it."""
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import mutations  # noqa: E402  (tools/ is not a package)


def times_found(path: str, text: str) -> int:
    return (ROOT / path).read_text().count(text)


@pytest.mark.parametrize("name, path, text", [entry[:3] for entry in mutations.MUTATIONS],
                         ids=[entry[0] for entry in mutations.MUTATIONS])
def test_every_bug_can_be_planted_in_exactly_one_place(name, path, text):
    assert times_found(path, text) == 1, f"{name}: its text is in {path} {times_found(path, text)} times, not once"


def test_a_bug_whose_text_moved_on_is_caught():
    assert times_found("src/ch4/mnist_3_ddp.py", 'if device.type == "cuda" else None)') == 0
