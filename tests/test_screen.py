"""A lesson reads on a 1,280-px screen without scrolling sideways: every line of a page's Python excerpt, as the
site shows it (tools/site_hooks.py moves a comment that runs past the block onto lines of its own above its
code), and every line of a command a reader types (```bash), fits the code block. CODE_COLUMNS, 110, was
measured once in headless Chromium 150 on the built site at a window 1,280 px wide: the code block is 906 px
inside its padding and the code font 8.18 px per character (with the table of contents in the left sidebar,
mkdocs.yml's toc.integrate)."""
import re
import sys

import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import site_hooks  # noqa: E402  (tools/ is not a package)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def wide_lines(blocks, markdown, columns):
    """The lines of the code blocks `blocks` finds in the markdown that are wider than `columns`."""
    return [line for match in blocks.finditer(markdown) for line in match["body"].splitlines() if len(line) > columns]


def too_wide(markdown, columns=site_hooks.CODE_COLUMNS):
    """The lines of the page's ```python blocks wider than the block, as the site shows them."""
    return wide_lines(site_hooks.PYTHON_BLOCK, site_hooks.fit_code_blocks(markdown, columns), columns)


BASH_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```bash[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def too_wide_commands(markdown, columns=site_hooks.CODE_COLUMNS):
    """The lines of the page's ```bash blocks wider than the block: a long command continues with a backslash."""
    return wide_lines(BASH_BLOCK, markdown, columns)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_line_fits_its_code_block(page):
    wide = too_wide_commands(page.read_text())
    assert not wide, f"{page.name}: {len(wide)} command lines wider than {site_hooks.CODE_COLUMNS} characters:\n" + \
        "\n".join(wide[:5])


def test_a_long_command_is_caught():
    command = "torchrun --nproc_per_node=4 " + " ".join(f"--flag-{i} value" for i in range(8))
    assert too_wide_commands(f"```bash\n{command}\n```\n") == [command]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_excerpt_line_fits_its_code_block(page):
    wide = too_wide(page.read_text())
    assert not wide, f"{page.name}: {len(wide)} lines wider than {site_hooks.CODE_COLUMNS} characters, e.g.\n" + \
        "\n".join(wide[:5])


def test_a_long_comment_moves_above_its_code_and_long_code_is_caught():
    reason = "# STEP: " + "a reason that runs on " * 8
    markdown = f"```python\n    model = DDP(model)  {reason}\n    short = 1  # fits\n```\n"
    shown = site_hooks.fit_code_blocks(markdown)
    assert "    model = DDP(model)\n" in shown and "    short = 1  # fits\n" in shown
    assert shown.index("# STEP: a reason") < shown.index("model = DDP(model)")
    assert not too_wide(markdown)
    code = "    total = " + " + ".join(f"value_{i}" for i in range(12))  # 139 characters of code, no comment
    assert too_wide(f"```python\n{code}  # STEP\n```\n") == [code]


def test_a_string_holding_a_hash_is_code_not_a_comment():
    line = '    print("# not a comment, " * 5 + "x" * 60)  # the comment'
    assert site_hooks.split_comment(line) == ('    print("# not a comment, " * 5 + "x" * 60)', "# the comment")


def test_the_measured_width_assumes_the_contents_in_the_left_sidebar():
    features = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["theme"]["features"]
    assert "toc.integrate" in features, "CODE_COLUMNS was measured with toc.integrate; measure it again without"
