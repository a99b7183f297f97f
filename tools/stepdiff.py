"""The lesson of one step: a unified diff of two neighbouring chapter scripts with the `# STEP` marks
compared away.

A child script marks the lines its step changes and drops the marks of its parent's step, so plain
`diff` also shows every line whose only change is a mark it lost. This diff compares the lines with
their marks removed on both sides: a line the step does not change is context, and the lines it
adds show with their marks and the reason written after them.

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


def without_mark(line):
    return MARKED.sub("", line).rstrip()


def matcher(before, after):
    """difflib's matcher for two lists of lines, compared with their marks removed."""
    return difflib.SequenceMatcher(a=[without_mark(line) for line in before],
                                   b=[without_mark(line) for line in after], autojunk=False)


def stepdiff(before, after, before_name="parent", after_name="child", context=3):
    """Unified diff lines: removed lines without their parent's marks, added lines as the child has them."""
    out = [f"--- {before_name}", f"+++ {after_name}"]
    for group in matcher(before, after).get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out.extend(f" {line}" for line in after[b1:b2])
                continue
            out.extend(f"-{without_mark(line)}" for line in before[a1:a2])
            out.extend(f"+{line}" for line in after[b1:b2])
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
    lines = stepdiff(args.parent.read_text().splitlines(), args.child.read_text().splitlines(),
                     str(args.parent), str(args.child), args.context)
    print("\n".join(lines))
    return 1 if lines else 0  # as diff: 1 when the files differ


if __name__ == "__main__":
    sys.exit(main())
