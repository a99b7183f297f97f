"""ruff, with pyproject's rules, finds nothing in the repository: unused names, undefined names, lines wider than
150 characters, and imports out of order (one line per module, sorted), which the chapter scripts keep too."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent))  # the suite's own environment's ruff


def ruff(*paths, cwd=ROOT):
    return subprocess.run([RUFF, "check", "--no-cache", *map(str, paths)], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_finds_nothing():
    result = ruff(".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_catches_imports_out_of_order(tmp_path):
    """Negative control: with the project's own settings, a planted file whose imports are out of order, or
    which imports one module on two lines, fails."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "planted.py").write_text("import torch\nimport os\n\nprint(os, torch)\n")
    assert "I001" in ruff("planted.py", cwd=tmp_path).stdout
    (tmp_path / "planted.py").write_text("from common.cli import a\nfrom common.cli import b\n\nprint(a, b)\n")
    assert "I001" in ruff("planted.py", cwd=tmp_path).stdout

