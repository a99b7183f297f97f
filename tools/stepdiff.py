"""The lesson of one step: a unified diff of two neighbouring chapter scripts with the `# STEP` marks
compared away.

A child script marks the lines its step changes and drops the marks of its parent's step, so plain
`diff` also shows every line whose only change is a mark it lost. This diff compares the lines with
their marks removed on both sides: a line the step does not change is context, and the lines it
adds show with their marks and the reason written after them.

Import lines carry no mark (one line per module, sorted, so that an import sorter keeps them in order):
an import line the step changes shows the names it adds, `# STEP: imports NAME, ...`, written by this tool.

    python tools/stepdiff.py src/ch4/mnist_2_data_parallel.py src/ch4/mnist_3_ddp.py
    python tools/stepdiff.py --context 1 src/ch4/mnist_3_ddp.py src/ch4/scale_out/mnist_comm_hooks.py
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

MARK = "# STEP"
MARKED = re.compile(r"(?<!`)\s*# STEP\b.*$")  # a mark ends a line of code; "`# STEP`" in a docstring is text
IMPORT = re.compile(r"^(?:import (?P<modules>[\w., ]+)|from (?P<module>[\w.]+) import (?P<names>[\w., ]+))(?:\s*#.*)?$")


def without_mark(line):
    return MARKED.sub("", line).rstrip()


def joined_imports(lines):
    """The lines with each import an import sorter wrapped in parentheses joined back into one line, as it reads."""
    out, wrapped = [], None
    for line in lines:
        if wrapped is not None:
            if line.strip() == ")":
                out.append(f"{wrapped[0]}{', '.join(wrapped[1])}")
                wrapped = None
            else:
                wrapped[1].append(line.strip().rstrip(","))
        elif re.match(r"^from [\w.]+ import \($", line):
            wrapped = (line[:-1], [])
        else:
            out.append(line)
    return out


def is_import(line):
    return bool(IMPORT.match(line))


def imported_names(lines):
    """Every name the top-level import lines bring in, as `module.name` (or the module for a plain import)."""
    names = set()
    for line in lines:
        if match := IMPORT.match(line):
            if match["module"]:
                names.update(f"{match['module']}.{name.strip()}" for name in match["names"].split(","))
            else:
                names.update(name.strip() for name in match["modules"].split(","))
    return names


def with_import_mark(line, parent_names):
    """An import line as the lesson shows it: with the names it adds to the parent's imports, if any."""
    module = IMPORT.match(line)["module"]
    added = sorted(name.removeprefix(f"{module}.") if module else name for name in imported_names([line]) - parent_names)
    return f"{line}  {MARK}: imports {', '.join(added)}" if added else line


def matcher(before, after):
    """difflib's matcher for two lists of lines, compared with their marks removed."""
    return difflib.SequenceMatcher(a=[without_mark(line) for line in before],
                                   b=[without_mark(line) for line in after], autojunk=False)


def stepdiff(before, after, before_name="parent", after_name="child", context=3):
    """Unified diff lines: removed lines without their parent's marks, added lines as the child has them."""
    out = [f"--- {before_name}", f"+++ {after_name}"]
    parent_names = imported_names(before)
    for group in matcher(before, after).get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out.extend(f" {line}" for line in after[b1:b2])
                continue
            out.extend(f"-{without_mark(line)}" for line in before[a1:a2])
            out.extend(f"+{with_import_mark(line, parent_names) if is_import(line) else line}" for line in after[b1:b2])
    return out if len(out) > 2 else []


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parent", type=Path)
    parser.add_argument("child", type=Path)
    parser.add_argument("--context", type=int, default=3, help="unchanged lines shown around each change")
    args = parser.parse_args(argv)
    for path in (args.parent, args.child):
        if not path.is_file():
            parser.error(f"{path} is not a file: pass two chapter scripts, e.g. src/ch4/mnist_2_data_parallel.py src/ch4/mnist_3_ddp.py")
    lines = stepdiff(joined_imports(args.parent.read_text().splitlines()), joined_imports(args.child.read_text().splitlines()),
                     str(args.parent), str(args.child), args.context)
    print("\n".join(lines))
    return 1 if lines else 0  # as diff: 1 when the files differ


if __name__ == "__main__":
    sys.exit(main())
