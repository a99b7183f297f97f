"""Record what the commands a page quotes really print, and write it into the page.

A page asks for a recording with a spec between two markers; the commands are what a reader types:

    <!-- record NAME
    $ python src/ch4/mnist_1_single.py --data-dir data
    $ torchrun --nproc_per_node=2 src/ch4/mnist_3_ddp.py --data-dir data
    drop: ^Setting OMP_NUM_THREADS       (optional: output lines matching this are left out)
    timeout: 900                          (optional: seconds for the whole block, 600 if not given)
    exit: any                             (optional: a command is meant to fail)
    needs: gpu                            (optional: gpu or slurm, hardware the recorder may lack)
    -->
    ...the recorder writes a text block and the line naming the machine here...
    <!-- end record -->

`make docs-outputs` (this script) runs the commands of every spec in one bash shell from the repository
root, and writes what they printed (less torchrun's notice that it set OMP_NUM_THREADS) into the page
between the markers and into
docs/outputs/PAGE/NAME.json, with the machine, the torch version, the date and a hash of every file that
produced it: the files the commands name and, for Python files, the repository modules they import.
The output goes into the page itself, not an include, so that the page reads the same on GitHub and in
the site. tests/test_site.py fails when a page's block is not its recording, when an output block has no
spec, and when a file behind a recording changed after it (re-record with this script).

    python tools/record_outputs.py --data-dir ../shared/data           # every spec
    python tools/record_outputs.py --only mnist.md --data-dir D         # one page (or PAGE:NAME)
    python tools/record_outputs.py --status                              # what is stale, without running
"""
import argparse
import ast
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OUTPUTS = DOCS / "outputs"
REGION = re.compile(r"^<!-- record ([a-z0-9-]+)\n(.*?)^-->\n(.*?)^<!-- end record -->$", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1$", re.MULTILINE | re.DOTALL)
OPTIONS = {"drop", "timeout", "exit", "needs"}
NEEDS = {"gpu": "a GPU", "slurm": "a SLURM cluster (sbatch on the PATH)"}
SOURCE = re.compile(r"(?<![\w./-])((?:src|common|planner|benchmarks|tools|figures|slurm|tests)/[\w./-]*\.(?:py|yaml|yml|sh|sbatch))")
MODULE = re.compile(r"(?:^|\s)-m\s+([\w.]+)")
IMPORTED = re.compile(r"\b(?:from|import)\s+([\w.]+)")  # in `python -c "..."` commands


# torchrun's four-line notice that it set OMP_NUM_THREADS=1, left out of every recording
TORCHRUN_NOTICE = re.compile(r"^(?=\S)(W\d{4} \S+ \d+ \S*torch/distributed/run\.py:\d+\]\s*)?"
                             r"(\*{5,}|Setting OMP_NUM_THREADS environment variable .*)?$")


class SpecError(ValueError):
    pass


def parse_spec(page, name, text):
    commands, options = [], {}
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:].strip())
        elif line.strip():
            key, _, value = line.partition(":")
            if key.strip() not in OPTIONS or not value.strip():
                raise SpecError(f"{page}, record {name}: '{line}' is neither a `$ ` command nor one of {sorted(OPTIONS)}")
            options[key.strip()] = value.strip()
    if not commands:
        raise SpecError(f"{page}, record {name}: no `$ ` command")
    if options.get("needs", "gpu") not in NEEDS:
        raise SpecError(f"{page}, record {name}: needs is one of {sorted(NEEDS)}")
    return {"commands": commands, "options": options}


def regions(page_path):
    """(name, spec, body, span) of every record region of the page, in order."""
    text = page_path.read_text()
    found, names = [], set()
    for match in REGION.finditer(text):
        name = match.group(1)
        if name in names:
            raise SpecError(f"{page_path.name}: two records named {name}")
        names.add(name)
        found.append((name, parse_spec(page_path.name, name, match.group(2)), match.group(3), match.span(3)))
    return found


def pages():
    return sorted(DOCS.glob("*.md"))


def recording_path(page_path, name):
    return OUTPUTS / page_path.stem / f"{name}.json"


def module_file(module, near):
    """The repository file of an imported module: a package module (planner.plan) or a sibling script's."""
    for base in (ROOT, near):
        for candidate in (base / Path(*module.split(".")).with_suffix(".py"), base / Path(*module.split(".")) / "__init__.py"):
            if candidate.is_file() and ROOT in candidate.resolve().parents:
                return candidate
    return None


def imported_files(path):
    """The repository Python files `path` imports, transitively (common/, planner/, and a script's own siblings)."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in ast.walk(ast.parse(current.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            todo.extend(found for name in names if (found := module_file(name, current.parent)))
    return seen


def source_files(commands):
    """Every repository file behind the commands: the files they name and the modules those import."""
    files = set()
    for command in commands:
        for path in SOURCE.findall(command):
            if (ROOT / path).is_file():
                files.add(ROOT / path)
        for module in MODULE.findall(command):
            if found := module_file(module, ROOT):
                files.add(found)
        for module in IMPORTED.findall(command):  # a `python -c` that imports a test helper puts tests/ on its path
            if found := module_file(module, ROOT / "tests"):
                files.add(found)
    for path in [path for path in files if path.suffix == ".py"]:
        files |= imported_files(path)
    return sorted(files)


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def fingerprint(commands):
    return {path.relative_to(ROOT).as_posix(): digest(path) for path in source_files(commands)}


def changed_sources(recording, root=ROOT):
    """The files behind a recording that differ from when it was made (in the tree at `root`)."""
    return sorted(path for path, old in recording["sources"].items()
                  if not (root / path).is_file() or digest(root / path) != old)


def render(recording):
    """What a page shows between its markers for this recording."""
    needs = recording["options"].get("needs")
    where = f"{recording['machine']}, torch {recording['torch']}, {recording['date']}"
    note = f" (needs {NEEDS[needs]}: not re-recorded on other machines)" if needs else ""
    body = "\n".join(recording["output"]).replace("```", "'''")
    return f"```text\n{body}\n```\n\n*Recorded by `make docs-outputs` on {where}{note}.*\n"


def load(page_path, name):
    path = recording_path(page_path, name)
    return json.loads(path.read_text()) if path.is_file() else None


def unrecorded_output_fences(text):
    """Fenced blocks outside record regions that look like outputs: no language, or a `$ ` line."""
    outside = REGION.sub("", text)
    return [body for fence, info, body in FENCE.findall(outside)
            if not info.strip() or any(line.startswith("$ ") for line in body.splitlines())]


def clean(output, drop):
    lines = []
    for line in output.splitlines():
        line = line.split("\r")[-1].rstrip()  # a progress bar keeps only its last state
        line = line.replace(f"{ROOT}/", "").replace(str(ROOT), ".")  # paths as a reader's clone has them
        if TORCHRUN_NOTICE.match(line) or (drop and re.search(drop, line)):
            continue
        lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def missing_hardware(needs):
    if needs == "gpu":
        import torch
        return not torch.cuda.is_available()
    return needs == "slurm" and shutil.which("sbatch") is None


def run_spec(spec, data_dir):
    """Run the commands in one bash shell, each echoed as `$ command`; returns (exit code, output lines)."""
    script = ["set -e" if spec["options"].get("exit") != "any" else "set +e"]
    for command in spec["commands"]:
        executed = command.replace("--data-dir data", f"--data-dir {data_dir}") if data_dir else command
        script.append(f"printf '%s\\n' {shlex.quote('$ ' + command)}")
        script.append(executed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=int(spec["options"].get("timeout", 600)))
    return result.returncode, clean(result.stdout, spec["options"].get("drop"))


def machine_description(device=None):
    """The machine's name, and on a CPU whether it has bf16 units: without them bf16 is emulated, several times
    slower than fp32, and --precision auto picks fp32, so both the speeds and the precision a page shows depend on it."""
    from common.machine import machine_name
    from common.precision import cpu_has_bf16
    if device is not None:
        return machine_name(device)
    return f"{machine_name()} {'with' if cpu_has_bf16() else 'without'} bf16 units"


def record(page_path, name, spec, data_dir):
    import torch
    code, output = run_spec(spec, data_dir)
    if code != 0 and spec["options"].get("exit") != "any":
        tail = "\n".join(output[-15:])
        raise RuntimeError(f"{page_path.name}, record {name}: exited with {code} (add `exit: any` if meant):\n{tail}")
    device = torch.device("cuda") if spec["options"].get("needs") == "gpu" else None
    recording = {**spec, "output": output, "machine": machine_description(device), "torch": torch.__version__.split("+")[0],
                 "date": datetime.date.today().isoformat(), "sources": fingerprint(spec["commands"])}
    path = recording_path(page_path, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recording, indent=1) + "\n")
    write_into_page(page_path, name, recording)


def write_into_page(page_path, name, recording):
    text = page_path.read_text()
    match = next(match for match in REGION.finditer(text) if match.group(1) == name)
    page_path.write_text(text[:match.start(3)] + render(recording) + text[match.end(3):])


def status(page_path, name, spec):
    recording = load(page_path, name)
    if recording is None:
        return "not recorded"
    if {key: recording[key] for key in ("commands", "options")} != spec:
        return "spec changed"
    if changed := changed_sources(recording):
        return "stale: " + ", ".join(changed)
    return "current"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="a folder holding MNIST/raw: replaces `--data-dir data` in the commands run")
    parser.add_argument("--only", nargs="*", default=[], help="PAGE or PAGE:NAME (e.g. mnist.md:ladder)")
    parser.add_argument("--stale", action="store_true", help="record only what is not current")
    parser.add_argument("--status", action="store_true", help="say what each recording's state is; run nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    failed, skipped = [], []
    for page_path in pages():
        for name, spec, _, _ in regions(page_path):
            key = f"{page_path.name}:{name}"
            if args.only and page_path.name not in args.only and key not in args.only:
                continue
            state = status(page_path, name, spec)
            if args.status or (args.stale and state == "current"):
                print(f"{key}: {state}")
                continue
            if missing_hardware(spec["options"].get("needs")):
                skipped.append(f"{key}: needs {NEEDS[spec['options']['needs']]}, not re-recordable here ({state})")
                continue
            print(f"{key}: recording ...", flush=True)
            try:
                record(page_path, name, spec, args.data_dir)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failed.append(f"{key}: {error}")
                print(f"{key}: FAILED", flush=True)
    for line in skipped:
        print(line)
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
