"""The notebooks run: every code cell is executed in order, with the inputs pointed at tiny test data."""
import json

import pytest
import torch

from conftest import EVAL_PAIRS, ROOT, TEST_IMAGES


def expectations(tiny_mnist, tiny_bert, nli_pairs):
    """For each notebook: the variables to override after the cell that sets them, and what must be printed."""
    return {
        "mnist_ladder.ipynb": ({"DATA_DIR": str(tiny_mnist)},
                               ["DistributedSampler       10003 indices, 10000 distinct",
                                "DistributedEvalSampler   10000 indices, 10000 distinct",
                                *[f"over {TEST_IMAGES} images"] * 3]),
        "nli_notebook_launcher.ipynb": ({"MODEL": str(tiny_bert), "DATASET": str(nli_pairs), "MAX_STEPS": 3},
                                        ["2 processes on cpu", f"over {EVAL_PAIRS} pairs"]),
    }


def test_every_notebook_is_tested():
    assert {path.name for path in (ROOT / "notebooks").glob("*.ipynb")} == set(expectations(None, None, None))


@pytest.mark.parametrize("name", ["mnist_ladder.ipynb", "nli_notebook_launcher.ipynb"])
def test_notebook_cells_run(name, tiny_mnist, tiny_bert, nli_pairs, capfd, monkeypatch):
    overrides, expected = expectations(tiny_mnist, tiny_bert, nli_pairs)[name]
    monkeypatch.chdir(ROOT / "notebooks")
    for variable in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.nn.functional.layer_norm(torch.randn(512, 64), (64,))  # a kernel that has used its OpenMP threads
    torch.set_num_threads(threads)
    namespace = {}
    for index, cell in enumerate(json.loads((ROOT / "notebooks" / name).read_text())["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{name} cell {index}", "exec"), namespace)
            namespace.update({key: value for key, value in overrides.items() if key in namespace})
    printed = capfd.readouterr().out
    for line in set(expected):
        assert printed.count(line) == expected.count(line), f"expected {line!r} {expected.count(line)} time(s):\n{printed}"
