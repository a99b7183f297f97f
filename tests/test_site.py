"""The course reads in one order and its outputs are real: the site builds with --strict (every link, anchor and
page checked), the nav is README's reading order, and every output a page shows is a recording of today's files
(tools/record_outputs.py, `make docs-outputs`)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import record_outputs  # noqa: E402  (tools/ is not a package)

MKDOCS = [sys.executable, "-m", "mkdocs"]
PAGES = sorted(path.name for path in (ROOT / "docs").glob("*.md"))
REGIONS = [(page.name, name) for page in record_outputs.pages() for name, _, _, _ in record_outputs.regions(page)]


def nav_pages(nav=None):
    """The nav's pages, flattened in reading order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"] if nav is None else nav
    flat = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            flat.extend(nav_pages(value) if isinstance(value, list) else [value])
    return flat


def chapters():
    """The reading order's chapters: the nav's top-level pages after the home page."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [value for entry in nav for value in entry.values() if isinstance(value, str) and value != "index.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`make docs` into a temporary folder, once for the tests that read the built site."""
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run([*MKDOCS, "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return site


def test_the_site_builds_with_strict_checks(site):
    """`make docs`: a broken link, anchor, include or a page left out of the nav fails the build."""
    assert (site / "index.html").is_file() and (site / "mnist" / "index.html").is_file()
    assert (site / "repo" / "src" / "ch4" / "mnist_3_ddp.py" / "index.html").is_file()


# ---- images: one copy, in the top-level images/, shown on GitHub and in the site ----

IMAGES = ROOT / "images"
IMAGE_LINK = re.compile(r"\]\(([^)\s#]+\.(?:png|svg|gif|jpe?g))\)")
EMBEDDED = re.compile(r"!\[[^\]]*\]\(([^)\s#]+)\)")  # ![alt](path): shown in the page
SITE_IMAGE = re.compile(r'<img [^>]*?src="([^"]+)"|<a [^>]*?href="([^"#]+\.(?:png|svg|gif|jpe?g))"')


def unresolved_images(markdown, source_dir):
    """The image links of a page in `source_dir` (of the repository) that, resolved as GitHub does, are not a
    file of images/."""
    return [link for link in IMAGE_LINK.findall(markdown)
            if (ROOT / source_dir / link).resolve().parent != IMAGES or not (ROOT / source_dir / link).is_file()]


def unresolved_site_images(site):
    """(page, src) of every <img src>, and every link to an image, of the built site that is not a file in it."""
    broken = []
    for html in sorted(site.rglob("*.html")):
        for src in filter(None, (group for found in SITE_IMAGE.findall(html.read_text()) for group in found)):
            if not (html.parent / src).resolve().is_file() or site.resolve() not in (html.parent / src).resolve().parents:
                broken.append((str(html.relative_to(site)), src))
    return broken


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{page}" for page in PAGES)])
def test_every_image_a_page_links_is_in_images(page):
    source_dir = "." if page == "README.md" else "docs"
    missing = unresolved_images((ROOT / page).read_text(), source_dir)
    assert not missing, f"{page} links images that are not files of images/ (link them as ../images/x.png): {missing}"


def test_the_site_shows_every_image_the_pages_link(site):
    """Every image a page links is in the built site, the bytes of images/; every image a page shows is an <img>
    of the page built from it; and every <img src> or image link of the site resolves to a file in it."""
    for page, source_dir in [("README.md", "."), *((f"docs/{page}", "docs") for page in PAGES)]:
        text = (ROOT / page).read_text()
        for link in IMAGE_LINK.findall(text):
            name = Path(link).name
            assert (site / "images" / name).read_bytes() == (IMAGES / name).read_bytes(), f"{page}: {link}"
        html = site / ("index.html" if page == "README.md" else f"{Path(page).stem}/index.html")
        shown = {(html.parent / src).resolve() for src in re.findall(r'<img [^>]*?src="([^"]+)"', html.read_text())}
        embedded = {(site / "images" / Path(link).name).resolve() for link in EMBEDDED.findall(text)}
        assert embedded <= shown, f"{page}: shown in no <img> of {html.relative_to(site)}: {sorted(embedded - shown)}"
    assert not unresolved_site_images(site)


def test_a_missing_image_is_found(tmp_path):
    """Negative control: a page linking an image that is not in images/, or by the old docs/-relative path, and
    a built page whose <img src> leads nowhere."""
    assert unresolved_images("![a figure](../images/mnist_speed_cpu.png)", "docs") == []
    assert unresolved_images("![a figure](images/mnist_speed_cpu.png)", ".") == []
    assert unresolved_images("![a figure](../images/missing.png)", "docs") == ["../images/missing.png"]
    assert unresolved_images("![a figure](images/mnist_speed_cpu.png)", "docs") == ["images/mnist_speed_cpu.png"]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "x.png").write_bytes(b"png")
    (tmp_path / "page").mkdir()
    (tmp_path / "page" / "index.html").write_text('<p><img alt="x" src="../images/x.png" /></p>')
    assert unresolved_site_images(tmp_path) == []
    (tmp_path / "page" / "index.html").write_text('<p><img alt="x" src="../images/y.png" /></p>')
    assert unresolved_site_images(tmp_path) == [("page/index.html", "../images/y.png")]


def test_every_page_is_in_the_nav_once():
    assert sorted(nav_pages()) == sorted({"index.md", *PAGES}) and len(nav_pages()) == len(set(nav_pages()))


def test_the_readme_lists_the_chapters_in_the_nav_order():
    start_here = (ROOT / "README.md").read_text().split("## Start here\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. .*?\]\(docs/([\w.]+\.md)\)", start_here, re.MULTILINE)
    assert listed == chapters()


def footer(page):
    lines = (ROOT / "docs" / page).read_text().rstrip().splitlines()
    return lines[-1] if lines[-1].startswith("Previous: ") else None


@pytest.mark.parametrize("page", PAGES)
def test_each_page_ends_with_its_neighbours_in_the_nav(page):
    """On GitHub, a page's last line links the pages before and after it in the nav; the site draws its own."""
    order = nav_pages()
    index = order.index(page)
    before = "../README.md" if order[index - 1] == "index.md" else order[index - 1]
    links = re.findall(r"\]\(([^)]+)\)", footer(page) or "")
    assert links[:1] == [before] and links[1:] == order[index + 1:index + 2], (
        f"docs/{page} must end with: Previous: [..]({before})" + (f" · Next: [..]({order[index + 1]})" if index + 1 < len(order) else ""))


LESSONS = chapters()
ONE_SITTING = 2500  # words of a chapter's running text: what a reader finishes in one sitting


def reading_words(text):
    """The words a reader reads through: not the <details> blocks, the appendices, code or recorded outputs."""
    text = re.sub(r"<details>.*?</details>", "", text, flags=re.S)
    text = re.sub(r"<!-- record.*?<!-- end record -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"^## Appendix.*?(?=^## |\Z)", "", text, flags=re.S | re.M)
    return len(re.findall(r"\w[\w'’.-]*", text))


@pytest.mark.parametrize("page", chapters())
def test_a_chapter_reads_in_one_sitting(page):
    words = reading_words((ROOT / "docs" / page).read_text())
    assert words <= ONE_SITTING, f"docs/{page}: {words} words of running text; move measurements and test notes " \
        f"into <details> or an appendix"


def test_the_word_count_leaves_out_only_what_a_reader_may_skip():
    text = "# T\n\nfour words of prose.\n\n<details>\nskipped words here\n</details>\n\n```bash\nls -l\n```\n"
    assert reading_words(text) == 5
    assert reading_words(text + "## Appendix: more\n\nnot counted\n\n## Back\n\ncounted\n") == 7
FORWARD_POINTER = re.compile(r"\blater\b|\bnext\b", re.IGNORECASE)  # "later in the course", "the next chapter"


def forward_links(text, page, order):
    """Links of a chapter page to a chapter after it, outside its footer, in a sentence that does not say so
    ("later", "next"): a reader would meet what that chapter teaches before it is taught."""
    body = re.sub(r"\n---\nPrevious: [^\n]*\n*\Z", "\n", text)
    found = []
    for paragraph in re.split(r"\n\s*\n", body):
        flat = " ".join(paragraph.split())
        for link in re.finditer(r"\]\(([\w]+\.md)(#[^)]*)?\)", flat):
            target = link[1]
            if target not in order or order.index(target) <= order.index(page):
                continue
            start = max(flat.rfind(". ", 0, link.start()), flat.rfind("\n", 0, link.start())) + 1
            end = flat.find(". ", link.end())
            if not FORWARD_POINTER.search(flat[start:end if end != -1 else len(flat)]):
                found.append(f"{target}: ...{flat[max(start, link.start() - 60):link.end()]}")
    return found


@pytest.mark.parametrize("page", chapters())
def test_a_chapter_points_forward_only_in_its_footer_or_as_later(page):
    wrong = forward_links((ROOT / "docs" / page).read_text(), page, chapters())
    assert not wrong, f"docs/{page} links to a later chapter without saying so:\n" + "\n".join(wrong)


def test_a_plain_forward_link_is_found():
    order = chapters()
    planted = "Sharded state uses [HSDP](hsdp.md) here. The [Traps](traps.md), later, say more.\n"
    assert [found.split(":")[0] for found in forward_links(planted, order[0], order)] == ["hsdp.md"]
    assert forward_links("Back to [the ladder](mnist.md).\n", order[-1], order) == []


@pytest.mark.parametrize("page", LESSONS)
def test_each_lesson_opens_with_what_you_will_learn(page):
    lines = [line for line in (ROOT / "docs" / page).read_text().splitlines() if line.strip()]
    assert lines[0].startswith("# ") and lines[1].startswith("> **You will learn**"), f"docs/{page}: line 2"
    opening = [line for line in lines[1:] if line.startswith(">")][:12]
    assert any(line.startswith("> **Read first:**") for line in opening), f"docs/{page}: no Read first in the opening"


def prose_lines(text):
    """The lines a reader reads as the lesson: outside fenced code and <details> blocks."""
    text = re.sub(r"^(`{3,}).*?^\1$", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)
    text = re.sub(r"\n\s*\n(\s*\n)+", "\n\n", text)  # a block taken out leaves one paragraph break, not its blank lines
    return [line for line in text.splitlines()]


@pytest.mark.parametrize("page", LESSONS)
def test_a_lesson_keeps_its_measurements_apart(page):
    assert len(prose_lines((ROOT / "docs" / page).read_text())) <= 250, f"docs/{page}: move tables and notes into <details>"


WORK_LOG = re.compile(r"\b(this session|these sessions|today|predates|found on the way|before the fix|not yet run|"
                      r"the test cluster|failed in \d+ of \d+|a run today)\b|/work/|/tmp/pytest", re.IGNORECASE)


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{page}" for page in PAGES)])
def test_no_page_reads_as_a_work_log(page):
    text = (ROOT / page).read_text()
    found = [line.strip() for line in prose_lines(text) if WORK_LOG.search(line)]
    assert not found, f"{page}: how the repo was built belongs in commit messages:\n" + "\n".join(found)


def test_the_work_log_check_finds_a_planted_phrase():
    assert WORK_LOG.search("This output predates the new model.") and not WORK_LOG.search("The ring predicts it.")


# ---- outputs: recorded by tools/record_outputs.py, never pasted ----

@pytest.mark.parametrize("page", ["README.md", *(f"docs/{page}" for page in PAGES)])
def test_every_output_block_is_a_recording(page):
    pasted = record_outputs.unrecorded_output_fences((ROOT / page).read_text())
    assert not pasted, (f"{page} shows an output that is not recorded (a fence with no language or with `$ ` lines): "
                        "write a record spec (tools/record_outputs.py), or give a fence that is not an output its "
                        "language:\n" + pasted[0][:400])


def test_a_pasted_output_is_found():
    """Negative control: an untagged block, or a block of `$` lines, outside a record region."""
    assert record_outputs.unrecorded_output_fences("text\n```\n$ python x.py\n42\n```\n")
    assert not record_outputs.unrecorded_output_fences("```bash\npython x.py\n```\n")


def recording_of(page, name):
    page_path = ROOT / "docs" / page
    spec = next(spec for found, spec, _, _ in record_outputs.regions(page_path) if found == name)
    return spec, record_outputs.load(page_path, name)


@pytest.mark.parametrize("page, name", REGIONS)
def test_each_page_shows_its_recording(page, name):
    spec, recording = recording_of(page, name)
    assert recording is not None, f"docs/{page}: record {name} was never recorded: make docs-outputs"
    assert {key: recording[key] for key in ("commands", "options")} == spec, (
        f"docs/{page}: record {name}'s spec changed since it was recorded: make docs-outputs")
    body = next(body for found, _, body, _ in record_outputs.regions(ROOT / "docs" / page) if found == name)
    assert body == record_outputs.render(recording), f"docs/{page}: record {name} was edited by hand"


@pytest.mark.parametrize("page, name", REGIONS)
def test_no_recording_is_older_than_its_files(page, name):
    _, recording = recording_of(page, name)
    if recording is None:
        pytest.fail(f"docs/{page}: record {name} was never recorded")
    changed = record_outputs.changed_sources(recording)
    if changed and recording["options"].get("needs"):
        pytest.skip(f"docs/{page}: record {name} is older than {changed}; it needs {recording['options']['needs']} to re-record")
    assert not changed, f"docs/{page}: record {name} is older than {changed}: make docs-outputs"


def test_a_changed_script_makes_its_recording_stale(tmp_path):
    """Negative control: one line added to a script behind a recording, or to a common/ module it imports."""
    commands = ["python src/ch4/mnist_1_single.py --data-dir data"]
    recording = {"sources": record_outputs.fingerprint(commands)}
    assert "common/mnist.py" in recording["sources"] and "src/ch4/mnist_1_single.py" in recording["sources"]
    for path in recording["sources"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    assert record_outputs.changed_sources(recording, tmp_path) == []
    with open(tmp_path / "common" / "mnist.py", "a") as module:
        module.write("\n# changed\n")
    assert record_outputs.changed_sources(recording, tmp_path) == ["common/mnist.py"]


def test_every_recording_belongs_to_a_page():
    recorded = {(path.parent.name + ".md", path.stem) for path in (ROOT / "docs" / "outputs").rglob("*.json")}
    assert recorded <= set(REGIONS), f"recordings no page asks for: {sorted(recorded - set(REGIONS))}"
