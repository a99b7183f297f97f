"""MkDocs hooks: the site is built from the same Markdown that reads on GitHub.

The pages link what GitHub shows beside them: `../src/ch4/ddp.py`, `../notebooks/x.ipynb`, the home page
is README.md. MkDocs serves only its docs folder, so these hooks
  - make README.md the site's home page, its `docs/` links pointing at the pages;
  - copy the figures of the top-level images/ into the site's images/ as they are, and point the image links
    (`../images/x.png` from a page, `images/x.png` from README) there: an image must show, not get a page;
  - give every file or folder outside docs/ that a page links a generated page of its own under repo/
    (a script as highlighted source, a notebook as its cells, a folder as the list of its files), and point
    the links there, so that a link from the site never leaves it and never breaks;
  - drop the `Previous: … · Next: …` line that ends each page for GitHub readers: the site's footer is
    generated from the nav in mkdocs.yml, which is the reading order;
  - fit a Python excerpt's lines to its code block: a comment that would run past CODE_COLUMNS goes on lines
    of its own above its code, so that a step's reason reads without scrolling.
"""
import io
import json
import posixpath
import re
import textwrap
import tokenize
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
IMAGES = "images"  # the one folder of figures, at the top of the repository and of the site
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")
FOOTER = re.compile(r"\n---\nPrevious: [^\n]*\n*\Z")
LANGUAGES = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".sh": "bash", ".sbatch": "bash", ".toml": "toml"}
SHOWN = {*LANGUAGES, ".ipynb", ".md", ".txt"}
# Characters a code block shows at 1,280 px, measured in headless Chromium 150 on the built site (toc.integrate
# puts the contents into the left sidebar): 906 px inside the block, 8.18 px per character of the code font.
CODE_COLUMNS = 110
TRAILING_COMMENT = re.compile(r"""^((?:[^'"#]|'[^']*'|"[^"]*")*?\S)\s+(#.*)$""")  # quotes closed before the #
PYTHON_BLOCK = re.compile(r"^(?P<opening>(?P<indent>[ \t]*)```python[^\n]*)\n(?P<body>.*?)^(?P<closing>(?P=indent)```)[ \t]*$",
                          re.M | re.S)


def generated_uri(target):
    return f"repo/{target}.md"


def rewrite_links(markdown, source_dir, location, wanted):
    """Links of a file in `source_dir` (of the repository), shown as the page at `location` (of the site):
    links into docs/ go to that page, links out of it to the outside target's generated page, noted in
    `wanted`."""
    def replace(match):
        prefix, link, anchor, suffix = match.groups()
        if re.match(r"^[a-z]+:", link):
            return match.group(0)
        target = posixpath.normpath(posixpath.join(source_dir, link))
        if target == "README.md":
            uri = "index.md"  # the site's home page
        elif target.startswith("docs/"):
            uri = posixpath.relpath(target, "docs")
        elif target.startswith(f"{IMAGES}/"):
            uri = target  # copied as it is by on_files; a missing one is left for MkDocs' check to report
        elif (ROOT / target).exists():
            wanted.add(target)
            uri = generated_uri(target)
        else:
            return match.group(0)  # left for MkDocs' own check to report
        return f"{prefix}{posixpath.relpath(uri, location)}{anchor or ''}{suffix}"
    return LINK.sub(replace, markdown)


def source_page(target):
    """The generated page of a file or folder outside docs/, and the outside targets it links in turn."""
    path = ROOT / target
    if path.is_dir():
        entries = sorted(p for p in path.iterdir() if not p.name.startswith((".", "__")))
        shown = [p for p in entries if p.is_dir() or p.suffix in SHOWN]  # text the site can show; the rest by name
        items = "\n".join(f"- [`{p.name}`]({path.name}/{p.name}.md)" if p in shown else f"- `{p.name}`" for p in entries)
        return f"# `{target}/`\n\n{items}\n", {f"{target}/{p.name}" for p in shown}
    if path.suffix == ".ipynb":
        links = set()
        content = rewrite_links(notebook_page(target, json.loads(path.read_text())), posixpath.dirname(target),
                                posixpath.dirname(generated_uri(target)), links)
        return content, links
    language = LANGUAGES.get(path.suffix, "text")
    return f"# `{target}`\n\n````{language}\n{path.read_text()}````\n", set()


def notebook_page(target, notebook):
    """A notebook's cells as a page: its Markdown as it is, its code as code (outputs come from running it)."""
    parts = [f"# `{target}`\n\n*Open it in Jupyter to run it; the tests execute it top to bottom.*\n"]
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        parts.append(f"````python\n{source}\n````\n" if cell["cell_type"] == "code" else f"{source}\n")
    return "\n".join(parts)


def on_files(files, config):
    """README as the home page; the figures of images/ as they are; a generated page for every other file or
    folder outside docs/ that a page links."""
    files.append(File.generated(config, "index.md", content=(ROOT / "README.md").read_text()))
    for image in sorted((ROOT / IMAGES).iterdir()):
        if image.is_file() and not image.name.startswith("."):
            files.append(File(f"{IMAGES}/{image.name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                              use_directory_urls=config.use_directory_urls))
    todo = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rewrite_links(page.read_text(), "." if page == ROOT / "README.md" else "docs", ".", todo)
    done = set()
    while todo:
        target = todo.pop()
        done.add(target)
        content, links = source_page(target)
        todo |= links - done
        files.append(File.generated(config, generated_uri(target), content=content, inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def split_comment(line):
    """The code of a line and its trailing comment ("" where it has none); a `#` inside a string is code."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):  # one line of a statement that spans several
        match = TRAILING_COMMENT.match(line)
        return (match[1], match[2]) if match else (line.rstrip(), "")
    comment = next((token for token in tokens if token.type == tokenize.COMMENT), None)
    if comment is None:
        return line.rstrip(), ""
    return line[:comment.start[1]].rstrip(), comment.string


def fit_line(line, columns=CODE_COLUMNS):
    """The line as the site shows it: as it is where it fits, else its comment wrapped on lines above its code."""
    if len(line) <= columns:
        return [line]
    code, comment = split_comment(line)
    if not comment:
        return [line]  # code alone past the width: tests/test_site.py reports it
    indent = line[:len(line) - len(line.lstrip())]
    words = comment.removeprefix("#").strip()
    above = textwrap.wrap(words, columns - len(indent) - 2, break_on_hyphens=False, break_long_words=False)
    return [f"{indent}# {text}" for text in above] + ([code] if code.strip() else [])


def fit_code_blocks(markdown, columns=CODE_COLUMNS):
    """Every ```python block of a page with its lines fitted to the code block (fit_line)."""
    def fit(match):
        lines = [fitted for line in match["body"].splitlines() for fitted in fit_line(line, columns)]
        return f"{match['opening']}\n" + "".join(f"{line}\n" for line in lines) + match["closing"]
    return PYTHON_BLOCK.sub(fit, markdown)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("repo/"):
        return markdown
    source_dir = "." if page.file.src_uri == "index.md" else "docs"
    markdown = markdown.replace("<details>", '<details markdown="1">')  # Markdown inside, as GitHub renders it
    return fit_code_blocks(rewrite_links(FOOTER.sub("\n", markdown), source_dir, ".", set()))
