"""The notebooks, executed as a user runs them: cell by cell in a real Jupyter kernel (nbclient + ipykernel).

A kernel is a process of its own, with its own __main__, ZMQ threads, working directory and output
capture, so what passes here passes in Jupyter. As papermill does, the test inserts a cell after the
one tagged `parameters` that points the notebook at tiny data, executes every cell with a time limit
per cell (a cell tagged `raises-exception` must raise, any other must not), and checks what the cells
printed. The committed notebooks carry no outputs: they come from a run on the reader's machine.
"""
import re

import nbformat
import pytest
from conftest import EVAL_PAIRS, ROOT, TEST_IMAGES, offline_env
from nbclient import NotebookClient

NOTEBOOKS = ROOT / "notebooks"
# notebook_launcher forks the kernel; a kernel that already ran torch on 2 threads hung its children
# (see docs/traps.md). A user's kernel usually has: so the test's kernel has too.
THREADED_KERNEL = "import torch\ntorch.set_num_threads(2)\ntorch.nn.functional.layer_norm(torch.randn(512, 64), (64,))\n"


RAISES = {"inside_ddp_ring.ipynb": "all_reduce_here is defined in a notebook"}


def expectations(tiny_mnist, tiny_bert, nli_pairs):
    """For each notebook: the parameters cell the test injects, and lines the cells must print (with counts)."""
    return {
        "mnist_ladder.ipynb": (f"DATA_DIR = {str(tiny_mnist)!r}",
                               ["DistributedSampler       10003 indices, 10000 distinct",
                                "DistributedEvalSampler   10000 indices, 10000 distinct",
                                *[f"over {TEST_IMAGES} images"] * 3]),
        "nli_notebook_launcher.ipynb": (f"MODEL = {str(tiny_bert)!r}\nDATASET = {str(nli_pairs)!r}\nMAX_STEPS = 3\n"
                                        + THREADED_KERNEL, ["2 processes on cpu", f"over {EVAL_PAIRS} pairs"]),
        "inside_ddp_ring.ipynb": ("NUMEL = 1000", ["rank 0 received 3 from its left neighbour", "rank 1 received 0 from", "4 ranks",
                                                   "reduce + broadcast   True", "all-to-all           True",
                                                   "ring                 True"]),
        "inside_ddp_buckets.ipynb": ("LAYERS = 4\nWIDTH = 128\nCAPS_MB = [0.1, 25]",
                                     ["0.10 | 4 | 1 / ", "25 | 1 | 1 / 1 |"]),
        "accumulation_no_sync.ipynb": ("", ["sync_every_micro_batch                   8 bucket all-reduces",
                                            "no_sync_around_backward_only             8 bucket all-reduces",
                                            "no_sync_around_forward_and_backward      2 bucket all-reduces"]),
    }


def execute(name: str, parameters: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters', has {len(tagged)}"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters, metadata={"tags": ["injected-parameters"]}))
    client = NotebookClient(notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=offline_env({"OMP_NUM_THREADS": "1"}))
    return notebook


def text_of(cell) -> str:
    """What a cell printed, and the message of the exception it raised."""
    return "".join(output.get("text", "") if output.output_type == "stream" else f"{output.get('ename')}: {output.get('evalue')}"
                   for output in cell.get("outputs", []) if output.output_type in ("stream", "error"))


def test_every_notebook_is_tested():
    assert {path.name for path in NOTEBOOKS.glob("*.ipynb")} == set(expectations(None, None, None))


@pytest.mark.parametrize("name", list(expectations(None, None, None)))
def test_notebook_runs_in_a_kernel(name, tiny_mnist, tiny_bert, nli_pairs):
    parameters, expected = expectations(tiny_mnist, tiny_bert, nli_pairs)[name]
    notebook = execute(name, parameters)
    printed = "".join(text_of(cell) for cell in notebook.cells if cell.cell_type == "code")
    for line in set(expected):
        assert printed.count(line) == expected.count(line), f"expected {line!r} {expected.count(line)} time(s):\n{printed}"
    for cell in notebook.cells:
        if "raises-exception" in cell.metadata.get("tags", []):
            errors = [output for output in cell.outputs if output.output_type == "error"]
            assert errors, f"a cell of {name} tagged raises-exception did not raise"
            assert RAISES[name] in text_of(cell), text_of(cell)  # and for the reason the notebook gives


def test_committed_notebooks_carry_no_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs: clear them"


def test_images_the_notebooks_show_exist():
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            for link in re.findall(r"\]\((\.\./[^)]+)\)", cell.source if cell.cell_type == "markdown" else ""):
                assert (NOTEBOOKS / link).resolve().exists(), f"{path.name} links {link}, which does not exist"
