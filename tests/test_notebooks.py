"""The notebooks run: each code cell is executed in order, with the training runs pointed at tiny data."""
import json

import pytest

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_cells_run(notebook, tiny_mnist, capsys, monkeypatch):
    monkeypatch.chdir(ROOT / "notebooks")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace = {}
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        exec(compile("".join(cell["source"]), f"{notebook.name} cell {index}", "exec"), namespace)
        if "DATA_DIR" in namespace:
            namespace["DATA_DIR"] = str(tiny_mnist)
    printed = capsys.readouterr().out
    assert "DistributedSampler       10003 indices, 10000 distinct" in printed
    assert "DistributedEvalSampler   10000 indices, 10000 distinct" in printed
    assert printed.count("test accuracy") == 3 and printed.count("over 101 images") == 3, printed


def test_there_is_a_notebook():
    assert NOTEBOOKS
