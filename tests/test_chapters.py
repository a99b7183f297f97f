"""Keep the chapters honest: neighbouring scripts differ only in lines marked `# STEP` (a line the
step deletes was a `# STEP` line of the script before, or is listed in DELETIONS), and every file
that a doc or a script's header tells the user to run exists."""
import ast
import difflib
import io
import re
import subprocess
import sys
import tokenize

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from stepdiff import MARK, imported_names, is_import, joined_imports, matcher, stepdiff, without_mark  # noqa: E402  (tools/ is not a package)

MNIST_LADDER = ["mnist_1_single.py", "mnist_2_data_parallel.py", "mnist_3_ddp.py", "mnist_4_accelerate.py"]
# Paths under src/ch4/: the seed's ladder at its root, each later chapter in the folder of its docs page.
STEPS = [*zip(MNIST_LADDER, MNIST_LADDER[1:]),  # each script is one step from the one before it
         ("mnist_3_ddp.py", "resume/mnist_3_ddp_resume.py"),  # a side step: the same script, restartable
         ("data_parallel.py", "nli_loss_in_forward.py"), ("data_parallel.py", "ddp.py"),
         ("ddp.py", "resume/ddp_resume.py"),
         ("nli_dp_minimal.py", "nli_ddp_minimal.py"),
         ("mnist_3_ddp.py", "sharded/mnist_fsdp.py"), ("ddp.py", "sharded/nli_fsdp.py"),
         ("sharded/mnist_fsdp.py", "resume/mnist_fsdp_resume.py"),  # the FSDP script, restartable: sharded checkpoints
         ("sharded/mnist_fsdp.py", "scale_out/mnist_hsdp.py"),  # the FSDP script on a 2-D mesh: HSDP
         ("mnist_3_ddp.py", "scale_out/mnist_comm_hooks.py"),  # fewer bytes per step: a DDP communication hook
         ("mnist_3_ddp.py", "scale_out/mnist_diloco.py"),  # fewer steps that communicate: local SGD and DiLoCo
         ("sharded/nli_fsdp.py", "sharded/nli_deepspeed.py"),  # DeepSpeed's engine
         ("resume/mnist_3_ddp_resume.py", "data_pipeline/mnist_workers.py"),  # augmentation from each worker's generator
         ("data_pipeline/mnist_workers.py", "data_pipeline/mnist_stateful.py"),  # torchdata's StatefulDataLoader
         ("data_pipeline/mnist_stateful.py", "data_pipeline/mnist_stream.py")]  # a datasets stream of Parquet shards
# Scripts that rewrite more than a step's share of the script they start from (MOST_MARKED): a framework or an
# engine takes over the loop. Each is a base of its own, and the page named here shows it whole.
REWRITES = {"nli_accelerate.py": "bert.md", "mnist_5_lightning.py": "lightning.md", "nli_trainer.py": "deepspeed.md",
            "fault_tolerant/mnist_3_ddp_ft.py": "fault_tolerant.md", "fault_tolerant/mnist_fsdp_ft.py": "fault_tolerant.md",
            "sharded/mnist_deepspeed.py": "deepspeed.md"}
BASES = ["mnist_1_single.py", "nli_dp_minimal.py", "data_parallel.py", *REWRITES]
# Not rungs: each program of the debugging gallery holds one bug and, behind --fixed, its fix
# (tests/test_debugging.py runs both).
GALLERY = sorted(f"debugging/{path.name}" for path in (ROOT / "src" / "ch4" / "debugging").glob("*.py"))
COMPILE_LINE = "model = compiled(model, args.compile)  # --compile: torch.compile(model), else the model itself"
COMPILE_IMPORT = "from common.compile import compiled"
DELETIONS = {  # unmarked lines of the earlier script that a step deletes on purpose
    # Accelerate casts (mixed_precision) and scales the loss itself: the autocast block and the scaler go
    ("mnist_3_ddp.py", "mnist_4_accelerate.py"): ["precision = resolve_precision(args.precision, device)", COMPILE_LINE,
                                                  "with autocast(device, precision):", "scaler.update()"],
    ("mnist_3_ddp.py", "resume/mnist_3_ddp_resume.py"): [COMPILE_LINE],
    ("ddp.py", "resume/ddp_resume.py"): [COMPILE_LINE],  # as its MNIST twin: the resumed run is eager
    ("data_pipeline/mnist_stateful.py", "data_pipeline/mnist_stream.py"): [  # a stream has no sampler
        "train_sampler = ResumableDistributedSampler(train_set, batch_size, seed=args.seed)"],
    ("sharded/nli_fsdp.py", "sharded/nli_deepspeed.py"): [  # the engine (the Trainer) does these; DeepSpeed's forward turns autocast off
        'with autocast(device, precision):',
        'optimizer.zero_grad(set_to_none=True)',
        'scaler.unscale_(optimizer)  # fp16: the true gradients, so that the norm is measured on them',
        'nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)  # the total norm of the whole averaged gradient',
        'if optimizer_step(optimizer, scaler):  # False where fp16 loss scaling skipped the step',
        'args.max_grad_norm, total_steps - steps_done, progress)'],
}


def code_lines(name):
    """The script's lines after its header docstring, each import on one line (tools/stepdiff.py)."""
    source = (ROOT / "src" / "ch4" / name).read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    return joined_imports(source.splitlines()[docstring_end:])


def changes(before, after):
    """Lines of `after` whose code (marks aside) the diff adds, lines of `after` it keeps as they were,
    and lines of `before` it deletes without a replacement.

    Marks are compared away: a line that step 3 marked and step 4 keeps unmarked is unchanged code.
    """
    added, kept, deleted = [], [], []
    for tag, i1, i2, j1, j2 in matcher(before, after).get_opcodes():
        (kept if tag == "equal" else added).extend(after[j1:j2])
        if tag == "delete":
            deleted.extend(before[i1:i2])
        elif tag == "replace":
            deleted.extend(unreplaced(before[i1:i2], after[j1:j2]))
    return added, kept, deleted


def unreplaced(old, new):
    """The old lines of a replaced block that no new line stands for: each new line replaces the old line
    most like it, so five lines replaced by one marked line delete four."""
    left = list(old)
    for line in new:
        if left:
            left.remove(max(left, key=lambda candidate: difflib.SequenceMatcher(
                a=without_mark(candidate).strip(), b=without_mark(line).strip()).ratio()))
    return left


def unexplained_deletions(before_name, deleted):
    """Deleted lines that were neither a `# STEP` line of the earlier script nor listed in DELETIONS."""
    listed = DELETIONS.get(before_name, [])
    return [line for line in deleted if line.strip() and MARK not in line and line.strip() not in listed and not is_import(line)]


@pytest.mark.parametrize("before, after", STEPS)
def test_neighbours_differ_only_in_marked_lines(before, after):
    added, kept, deleted = changes(code_lines(before), code_lines(after))
    unmarked = [line for line in added if line.strip() and MARK not in line and not is_import(line)]
    silent = unexplained_deletions((before, after), deleted)
    assert not silent, f"{after} deletes lines of {before} that are neither marked there nor listed:\n" + "\n".join(silent)
    stale_list = set(DELETIONS.get((before, after), [])) - {line.strip() for line in deleted}
    assert not stale_list, f"DELETIONS lists lines {after} does not delete: {stale_list}"
    assert not unmarked, f"{after} changes lines of {before} without `{MARK}`:\n" + "\n".join(unmarked)
    stale = [line for line in kept if MARK in line and without_mark(line).strip()]
    assert not stale, f"{after} marks lines it does not change:\n" + "\n".join(stale)
    assert added, f"{after} changes nothing in {before}"


MOST_MARKED = 0.4  # of a rung's statements (its docstring and imports aside): more is a rewrite, not a step


def statements(lines):
    """The lines grouped by statement: a call wrapped over three lines is one statement, as it is one
    change to read, however the code block's width makes it break."""
    grouped, current = [], []
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    for token in tokens:
        if token.type in (tokenize.COMMENT, tokenize.NL) and not current:
            continue
        if token.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            current.extend(range(token.start[0], token.end[0] + 1))
        if token.type == tokenize.NEWLINE:
            grouped.append([lines[number - 1] for number in sorted(set(current))])
            current = []
    return grouped


def marked_share(name):
    """The share of the script's statements that carry `# STEP`: what its page shows as the lesson."""
    counted = [group for group in statements(code_lines(name)) if not is_import(group[0])]
    return sum(any(MARK in line for line in group) for group in counted) / len(counted)


@pytest.mark.parametrize("before, after", STEPS)
def test_a_step_changes_at_most_a_share_of_its_script(before, after):
    """A rung that rewrites much of its parent is a new base (BASES) whose page shows it whole, not a step."""
    assert marked_share(after) <= MOST_MARKED, (
        f"{after} marks {marked_share(after):.0%} of its statements against {before}: split it into two steps, "
        f"or make it a base whose page shows it whole")


def test_the_share_rule_catches_a_rewrite(monkeypatch):
    """Negative control: the same rung with half of its unmarked lines marked fails the rule."""
    lines = code_lines("mnist_3_ddp.py")
    unmarked = [i for i, line in enumerate(lines) if line.strip() and MARK not in line and not is_import(line)]
    rewritten = [f"{line}  {MARK}" if i in unmarked[::2] else line for i, line in enumerate(lines)]
    monkeypatch.setattr(sys.modules[__name__], "code_lines", lambda name: rewritten)
    assert marked_share("mnist_3_ddp.py") > MOST_MARKED


SCRIPTS = sorted(path.relative_to(ROOT / "src" / "ch4").as_posix() for path in (ROOT / "src" / "ch4").rglob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_imports_carry_no_mark_and_one_line_per_module(name):
    """stepdiff shows the names an import adds; a mark on an import would stop an import sorter (ruff's I rules)
    from keeping them in order, and two lines of one module would be merged by it."""
    imports = [line for line in joined_imports((ROOT / "src" / "ch4" / name).read_text().splitlines()) if is_import(line)]
    assert not [line for line in imports if MARK in line], f"{name}: an import line with `{MARK}`"
    modules = [line.split()[1] for line in imports if line.startswith("from ")]
    assert len(modules) == len(set(modules)), f"{name}: two `from` lines of one module"


def test_stepdiff_names_what_an_import_adds():
    """The lesson diff marks the names a changed import line adds, and only those."""
    lines = stepdiff(["from common.cli import mnist_parser", "x = 1"],
                     ["from common.cli import mnist_parser, per_process_batch", "x = 1"])
    assert f"+from common.cli import mnist_parser, per_process_batch  {MARK}: imports per_process_batch" in lines
    assert imported_names(["import torch.distributed as dist", "from a.b import c, d"]) == {
        "torch.distributed as dist", "a.b.c", "a.b.d"}


def mark_only_changes(diff_lines):
    """Lines a unified diff shows as changed although only their `# STEP` mark differs: within one run of
    changed lines, a removed line and an added line with the same code."""
    found, removed, added = [], set(), set()
    for line in [*diff_lines, " "]:
        if line.startswith(("---", "+++")):
            continue
        if line[:1] in "-+":
            (removed if line[0] == "-" else added).add(without_mark(line[1:]))
        else:
            found.extend(sorted((removed & added) - {""}))
            removed, added = set(), set()
    return found


@pytest.mark.parametrize("before, after", STEPS)
def test_the_lesson_diff_shows_only_the_lesson(before, after):
    """`python tools/stepdiff.py PARENT CHILD`, the command the pages give, shows no line whose only change is
    a mark: the reader sees the step and nothing else."""
    lines = stepdiff(code_lines(before), code_lines(after))
    assert lines and not mark_only_changes(lines), f"{before} -> {after}: {mark_only_changes(lines)}"


def test_plain_diff_shows_the_marks_that_stepdiff_hides():
    """Negative control: plain diff of the same neighbours is full of lines that only lost a mark."""
    before, after = code_lines("mnist_3_ddp.py"), code_lines("scale_out/mnist_comm_hooks.py")
    assert len(mark_only_changes(list(difflib.unified_diff(before, after, lineterm="")))) > 10


DIFF_COMMAND = re.compile(r"(?<![\w/.-])diff (?:-\w+ )*(?:\.\./)?src/")


def test_readers_are_told_to_run_stepdiff_not_diff():
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src" / "ch4").rglob("*.py")),
             *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    plain = [f"{text.relative_to(ROOT)}: {line.strip()}" for text in texts for line in text.read_text().splitlines()
             if DIFF_COMMAND.search(line)]
    assert not plain, "tell readers `python tools/stepdiff.py PARENT CHILD`:\n" + "\n".join(plain)
    assert DIFF_COMMAND.search("see `diff src/ch4/a.py src/ch4/b.py`")  # the control: a plain diff is found
    assert not DIFF_COMMAND.search("python tools/stepdiff.py src/ch4/a.py src/ch4/b.py")


def test_stepdiff_runs_as_the_pages_say():
    result = subprocess.run([sys.executable, "tools/stepdiff.py", "src/ch4/mnist_2_data_parallel.py",
                             "src/ch4/mnist_3_ddp.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "+    model = DDP(" in result.stdout, result.stderr
    missing = subprocess.run([sys.executable, "tools/stepdiff.py", "nowhere.py", "src/ch4/mnist_3_ddp.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nowhere.py is not a file" in missing.stderr


@pytest.mark.parametrize("base", BASES)
def test_base_scripts_mark_nothing(base):
    assert not [line for line in code_lines(base) if MARK in line]


def test_every_chapter_script_is_checked():
    """In every chapter folder too: a script added to src/ch4/resume/ without a parent is caught here."""
    checked = {name for pair in STEPS for name in pair} | set(BASES) | set(GALLERY)
    ch4 = ROOT / "src" / "ch4"
    assert checked == {path.relative_to(ch4).as_posix() for path in ch4.rglob("*.py")}


def test_the_check_above_catches_an_unmarked_change():
    added, _, _ = changes(["a = 1", "b = 2"], ["a = 1", "b = 3"])
    assert added == ["b = 3"] and MARK not in added[0]


def test_the_check_above_catches_a_silent_deletion():
    """model.eval() deleted from a later step's evaluation is a change the reader would never see."""
    before = code_lines("mnist_3_ddp.py")
    after = [line for line in code_lines("mnist_4_accelerate.py") if line.strip() != "model.eval()"]
    _, _, deleted = changes(before, after)
    assert unexplained_deletions(("mnist_3_ddp.py", "mnist_4_accelerate.py"), deleted) == ["    model.eval()"]


def test_the_check_above_catches_a_deletion_inside_a_replaced_block():
    """Four unmarked lines replaced by one marked line: the three it does not stand for are deletions."""
    before = ["x = load()", "x = clean(x)", "x = check(x)", "model.eval()", "run(x)"]
    after = ["x = load_and_check()  # STEP", "run(x)"]
    _, _, deleted = changes(before, after)
    assert len(deleted) == 3 and "model.eval()" in deleted


# a name cut with an ellipsis (a table's long test id) names only the folders before the cut
PATH = re.compile(r"(?<![\w/.-])((?:src|benchmarks|slurm|notebooks|figures|tests|common|docs|tools|\.ci)/[\w./-]*\w)(?![\w…])")


OPTIONAL = {"slurm/site_env.sh"}  # a site's own file, which the job scripts source only if present


def documented_paths():
    texts = [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "src" / "ch4").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "figures").glob("*.py")), *sorted((ROOT / "slurm").glob("*.s*"))]
    return sorted({(text.name, path) for text in texts for path in PATH.findall(text.read_text())
                   if path not in OPTIONAL})


@pytest.mark.parametrize("where, path", documented_paths())
def test_every_named_path_exists(where, path):
    assert (ROOT / path).exists(), f"{where} names {path}, which does not exist"


def test_paths_are_found_in_docs():
    assert ("README.md", "src/ch4/mnist_3_ddp.py") in documented_paths()


def markdown_links():
    """Every relative link of the docs, with the file it must reach (resolved from the linking page)."""
    pages = [ROOT / "README.md", ROOT / "slurm" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return sorted({(page.relative_to(ROOT).as_posix(), link) for page in pages
                   for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
                   if not link.startswith(("http:", "https:", "mailto:"))})


@pytest.mark.parametrize("page, link", markdown_links())
def test_every_link_of_the_docs_resolves(page, link):
    assert (ROOT / page).parent.joinpath(link).exists(), f"{page} links {link}, which does not exist"


def test_the_readme_is_a_map():
    """Chapter prose lives in docs/: the README stays short enough to be read as the map it is, and links every
    page (tests/test_site.py checks that "Start here" is the site's reading order)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    linked = set(re.findall(r"\]\((docs/[\w.]+\.md)\)", (ROOT / "README.md").read_text()))
    assert linked == {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}  # every page is on the map


# ---- the change shown inline on each chapter page is the script's own text ----

CHAPTER_PAGES = ["mnist.md", "bert.md", "inside_ddp.md", "resume.md", "fault_tolerant.md", "sharded.md", "deepspeed.md", "lightning.md",
                 "hsdp.md", "compression.md", "compile.md"]
EXCERPT = re.compile(r'^```(?:python|bash) title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)
PAGES = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
GAP = "..."  # a line of its own in an excerpt: lines of the script left out here


def excerpts(page):
    """(path, lines) of each fenced block the page marks ```python title="PATH" (or bash): an excerpt of that file."""
    return [(path, text.splitlines()) for path, text in EXCERPT.findall((ROOT / "docs" / page).read_text())]


def not_in(excerpt, source):
    """The first run of the excerpt's lines (runs are split at GAP lines) that the source lacks, verbatim and
    after the run before it; None when the whole excerpt is the source's text in the source's order."""
    position = 0
    for run in "\n".join(excerpt).split(f"\n{GAP}\n"):
        lines = run.splitlines()
        found = next((i for i in range(position, len(source) - len(lines) + 1) if source[i:i + len(lines)] == lines), None)
        if found is None:
            return run
        position = found + len(lines)
    return None


@pytest.mark.parametrize("page, index", [(page, i) for page in PAGES for i in range(len(excerpts(page)))])
def test_each_excerpt_on_a_page_is_the_scripts_text(page, index):
    """On every page; a rung's page shows the rung's `# STEP` lines (the debugging gallery has no marks)."""
    path, excerpt = excerpts(page)[index]
    missing = not_in(excerpt, (ROOT / path).read_text().splitlines())
    assert missing is None, f"docs/{page} shows lines of {path} that it does not hold, in this order:\n{missing}"
    if page in CHAPTER_PAGES and path.removeprefix("src/ch4/") in {after for _, after in STEPS}:
        assert any(MARK in line for line in excerpt), f"docs/{page}: an excerpt of {path} with no `{MARK}` line"


@pytest.mark.parametrize("name", REWRITES)
def test_a_rewrite_is_shown_whole_on_its_page(name):
    """A base that rewrites its parent has no step to show: its page shows every line after the docstring."""
    source = (ROOT / "src" / "ch4" / name).read_text()
    code = "\n".join(source.splitlines()[ast.parse(source).body[0].end_lineno:]).strip("\n").splitlines()
    assert [path for path, lines in excerpts(REWRITES[name]) if path == f"src/ch4/{name}" and lines == code], (
        f"docs/{REWRITES[name]} does not show src/ch4/{name} whole (a ```python title=\"src/ch4/{name}\" block)")


@pytest.mark.parametrize("page", CHAPTER_PAGES)
def test_each_chapter_page_shows_its_change_inline(page):
    assert excerpts(page), f"docs/{page} shows no excerpt (```python title='PATH')"


def test_an_excerpt_stops_matching_when_the_script_changes():
    """Negative control: one character edited in the script, or two runs of the excerpt swapped, is caught."""
    path, excerpt = excerpts("mnist.md")[0]
    source = (ROOT / path).read_text().splitlines()
    assert not_in(excerpt, source) is None
    line = next(i for i, text in enumerate(source) if text == next(e for e in excerpt if MARK in e))
    edited = [*source[:line], source[line].replace("(", "( ", 1), *source[line + 1:]]
    assert not_in(excerpt, edited) is not None
    runs = "\n".join(excerpt).split(f"\n{GAP}\n")
    if len(runs) > 1:
        swapped = f"\n{GAP}\n".join([runs[1], runs[0], *runs[2:]]).splitlines()
        assert not_in(swapped, source) is not None


@pytest.mark.parametrize("page", sorted(path.name for path in (ROOT / "docs").glob("*.md")))
def test_no_two_figures_are_stacked_without_text_between(page):
    lines = [line for line in (ROOT / "docs" / page).read_text().splitlines() if line.strip()]
    stacked = [a for a, b in zip(lines, lines[1:]) if a.startswith("![") and b.startswith("![")]
    assert not stacked, f"docs/{page}: a figure follows {stacked[0]} with no sentence between them"
