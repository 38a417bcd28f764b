"""Rerun the commands the docs quote predictions from, and compare the quoted figures.

    python tools/docs_check.py [--update] [FILE.md ...]     (default: README.md docs/*.md)

A command is declared once in a markdown file, in a comment the reader does not see but
beside the command the reader does:
    <!-- docs-check NAME: python -m ctxpar.plan --config X.yaml --max-seq-len -->
and every figure quoted from its output carries a comment right after it:
    **5,154,736**<!-- NAME /longest seq_len: ([\\d,]+)/ -->
    30.6<!-- NAME /recompute +([\\d.]+) GB/ :.1f --> GB
The regex's first group, read from the command's output, is the figure; an optional
format (`:SPEC` or `/DIVISOR:SPEC`, Python's format mini-language on the number) rounds
it as the text does. Output quoted verbatim (a table's rows) carries one comment above it:
    <!-- docs-check-lines NAME /^\| \d+ \|/ -->
and the lines below it, up to the next blank line, that match the regex must be the
output's lines that match it. The check fails, one line per figure, when a quoted figure differs;
--update (`make docs-check UPDATE=1`) writes the commands' figures into the files instead.
Commands of the form `python -m ctxpar.plan ...` run in the process that checks them (no
interpreter start per command); each distinct command runs once, the commands spread over
the machine's cores (they are independent).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import itertools
import multiprocessing
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"<!-- docs-check ([\w-]+): (.+?) -->")
FIGURE = re.compile(r"(?P<fig>\d[\d,.]*?)(?P<stars>\**)<!-- (?P<name>[\w-]+) "
                    r"/(?P<re>.+?)/(?: (?P<spec>\S+))? -->")
LINES = re.compile(r"^<!-- docs-check-lines ([\w-]+) /(.+?)/ -->\n", re.MULTILINE)
PLANNER = "python -m ctxpar.plan "


@dataclass
class Figure:
    path: str
    line: int
    quoted: str
    name: str
    regex: str
    spec: Optional[str]
    start: int  # the figure's offset in the file
    end: int
    lines: bool = False  # a docs-check-lines block: quoted and the output's are lines


def parse(path: str, text: str):
    """(commands by name, figures) of one markdown file; a figure naming no command of
    its file is an error."""
    commands = {m.group(1): m.group(2) for m in COMMAND.finditer(text)}
    figures = []
    for m in FIGURE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m.group("name") not in commands:
            raise SystemExit(f"{path}:{line}: figure names '{m.group('name')}', which no "
                             f"<!-- docs-check {m.group('name')}: ... --> in the file declares")
        figures.append(Figure(path, line, m.group("fig"), m.group("name"), m.group("re"),
                              m.group("spec"), m.start("fig"), m.end("fig")))
    for m in LINES.finditer(text):
        line = text.count("\n", 0, m.start()) + 2
        if m.group(1) not in commands:
            raise SystemExit(f"{path}:{line - 1}: block names '{m.group(1)}', which no "
                             f"<!-- docs-check {m.group(1)}: ... --> in the file declares")
        block_end = text.find("\n\n", m.end())
        block_end = len(text) if block_end < 0 else block_end + 1
        rows = [(mm.start(), mm.end()) for mm in re.finditer(r"^.*$", text[m.end():block_end],
                                                             re.MULTILINE)
                if re.search(m.group(2), mm.group(0))]
        if not rows:
            raise SystemExit(f"{path}:{line}: no line below the block's comment matches "
                             f"/{m.group(2)}/")
        start, end = m.end() + rows[0][0], m.end() + rows[-1][1]
        figures.append(Figure(path, line + text.count("\n", m.end(), start), text[start:end],
                              m.group(1), m.group(2), None, start, end, lines=True))
    figures.sort(key=lambda f: f.start)
    return commands, figures


def run(command: str) -> str:
    """The command's stdout, run from the repository root."""
    if command.startswith(PLANNER):
        from ctxpar.plan.__main__ import main
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(shlex.split(command[len(PLANNER):]))
        finally:
            os.chdir(cwd)
        if rc:
            raise SystemExit(f"`{command}` exited {rc}: {err.getvalue().strip()}")
        return out.getvalue()
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"`{command}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _run_or_error(command: str):
    """(True, stdout) or (False, the one-line error): a worker's answer."""
    try:
        return True, run(command)
    except SystemExit as e:
        return False, str(e)


def outputs_of(commands: List[str]) -> Dict[str, str]:
    """Each command's stdout, the commands run side by side on the machine's cores; the
    first failure (in the commands' order) exits with its line."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    workers = min(len(commands), cores)
    if workers <= 1:
        return {c: run(c) for c in commands}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        answers = list(pool.map(_run_or_error, commands))
    for ok, out in answers:
        if not ok:
            raise SystemExit(out)
    return {c: out for c, (_, out) in zip(commands, answers)}


def figure_from(output: str, f: Figure, command: str) -> str:
    """The figure f quotes, as the command prints it now (formatted by f.spec)."""
    if f.lines:
        got = [ln for ln in output.splitlines() if re.search(f.regex, ln)]
        if not got:
            raise SystemExit(f"{f.path}:{f.line}: /{f.regex}/ matches no line of the output "
                             f"of `{command}`")
        return "\n".join(got)
    m = re.search(f.regex, output, re.MULTILINE)
    if not m:
        raise SystemExit(f"{f.path}:{f.line}: /{f.regex}/ matches nothing in the output of "
                         f"`{command}`")
    value = m.group(1)
    if not f.spec:
        return value
    divisor, _, spec = f.spec.partition(":")
    number = float(value.replace(",", "")) / (float(divisor[1:]) if divisor else 1.0)
    return format(round(number) if spec.endswith("d") else number, spec)


def check(paths: List[str], update: bool = False) -> List[str]:
    """One line per quoted figure that differs from its command's output (rewritten in
    place when update)."""
    files = []
    for path in paths:
        with open(path) as fh:
            text = fh.read()
        files.append((path, text, *parse(path, text)))
    needed = [commands[f.name] for _, _, commands, figures in files for f in figures]
    outputs = outputs_of(list(dict.fromkeys(needed)))
    diffs = []
    for path, text, commands, figures in files:
        new = text
        for f in reversed(figures):  # from the end: earlier offsets stay valid
            cmd = commands[f.name]
            now = figure_from(outputs[cmd], f, cmd)
            if now != f.quoted:
                quoted, printed = f.quoted, now
                if f.lines:  # the first line that differs
                    quoted, printed = next(
                        (q, n) for q, n in itertools.zip_longest(
                            f.quoted.splitlines(), now.splitlines(), fillvalue="(nothing)")
                        if q != n)
                diffs.append(f"{os.path.relpath(path, ROOT)}:{f.line}: quotes {quoted}, "
                             f"`{f.name}` prints {printed}")
                new = new[:f.start] + now + new[f.end:]
        if update and new != text:
            with open(path, "w") as fh:
                fh.write(new)
    return sorted(diffs)


def default_paths() -> List[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="*", help="markdown files (default: README.md docs/*.md)")
    p.add_argument("--update", action="store_true",
                   help="write the commands' figures into the files")
    a = p.parse_args(argv)
    diffs = check(a.paths or default_paths(), a.update)
    for d in diffs:
        print(("updated " if a.update else "") + d)
    if diffs and not a.update:
        print(f"docs-check: {len(diffs)} quoted figures differ from their commands; "
              f"`make docs-check UPDATE=1` writes the new ones")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
