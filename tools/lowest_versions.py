"""The lowest versions pyproject.toml allows, as pip constraints: each dependency with a lower bound (`>=`) pinned
to it, each pinned one (`==`) as it is, in the project's dependencies and in every extra `.[dev]` pulls in.

    python tools/lowest_versions.py > lowest.txt
    pip install -c lowest.txt -e '.[dev]'
    python tools/lowest_versions.py --record PYTEST_LOG    # in that environment, after its suite passed

make test-lowest does this in a virtual environment of its own (.venv-lowest) and runs the suite there, so that
every lower bound the project declares is a version the suite has passed on; --record writes what it ran on and
pytest's last line into docs/tests.md.
"""
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
PAGE = ROOT / "docs" / "tests.md"
BEGIN, END = "<!-- lowest -->", "<!-- end lowest -->"
BOUND = re.compile(r"^([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def requirements(extra: str = "dev") -> list[str]:
    """The project's dependencies and those of `extra`, the project's own extras it names followed."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found, extras, seen = list(project["dependencies"]), [extra], set()
    while extras:
        name = extras.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in project["optional-dependencies"][name]:
            own = re.match(rf"{project['name']}\[(.+)\]$", requirement)
            if own:
                extras += own.group(1).split(",")
            else:
                found.append(requirement)
    return found


def lowest(requirement: str) -> str | None:
    """`name==version` for a requirement with a lower bound or a pin (its marker kept), None for one without."""
    name, specifiers, marker = BOUND.match(requirement).groups()
    for specifier in specifiers.split(","):
        operator, version = re.match(r"\s*(>=|==|~=|<=|<|>|!=)?\s*(.*)", specifier).groups()
        if operator in (">=", "==", "~="):
            return f"{name}=={version}{' ' + marker if marker else ''}"
    return None


def passing_result(output: str) -> str | None:
    """pytest's closing line, if it says the suite passed: tests passed, and none failed or erred."""
    closing = [line.strip("= ") for line in output.splitlines() if " passed" in line and " in " in line]
    if not closing or any(word in closing[-1] for word in ("failed", "error")):
        return None
    return closing[-1]


def record(log: Path) -> str:
    """The page's table: this interpreter and the installed version of each pinned package, then pytest's result."""
    import platform
    from importlib.metadata import version

    sys.path.insert(0, str(ROOT / "tools"))
    from record_outputs import machine_description
    names = [pin.split("==")[0] for pin in map(lowest, requirements()) if pin]
    result = passing_result(log.read_text())
    if result is None:
        sys.exit(f"error: {log} holds no passing pytest result: nothing recorded.")
    rows = [f"| Python | {platform.python_version()} |"] + [f"| {name} | {version(name)} |" for name in names]
    return (f"`make test-lowest` on a {machine_description()}: **{result}**.\n\n"
            "| package | version |\n|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        page = PAGE.read_text()
        before, rest = page.split(BEGIN, 1)
        PAGE.write_text(f"{before}{BEGIN}\n{record(Path(sys.argv[2]))}\n{END}{rest.split(END, 1)[1]}")
    else:
        print("\n".join(pin for pin in map(lowest, requirements(*sys.argv[1:])) if pin))
