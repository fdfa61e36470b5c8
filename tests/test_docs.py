"""The documentation works as written: its runnable examples run, its links resolve, and nothing
in the repository points at design notes outside it.

A fenced block whose info string is ``bash runnable`` or ``python runnable`` in README.md or
docs/*.md is run from the repository root, as on a fresh clone after ``scripts/setup.sh``: bash
blocks under ``bash -euo pipefail``, python blocks with this interpreter, with its ``bin/`` (the
``kvtier`` command) first on ``PATH``. A block passes when it exits 0 (for python: raises
nothing); its own asserts check its results. ``runnable slow`` marks a heavy block, which runs
only with ``--run-slow``. Each block runs in its own process group, killed when it ends, so a
server a block starts in the background cannot outlive it; port 8000 in a block becomes a free
loopback port, so concurrent runs do not collide. A block that reads data from ``../shared``
(the tokenizer, traces) is skipped when that data is not beside the repository, and one that
calls curl when curl is not installed.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
BLOCK_TIMEOUT_S = 600
EXAMPLE_PORT = "8000"

# Pages linked from the docs that are written on another branch; a missing one is not yet an
# error. Remove a name once its page is in the tree.
PENDING_PAGES: set[str] = set()


def _blocks() -> list:
    params = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            words = m.group(1).split()
            if len(words) < 2 or words[1] != "runnable":
                continue
            lang = words[0]
            assert lang in ("bash", "python"), f"{path.name}: a runnable block must be bash or python, got {lang!r}"
            line = text.count("\n", 0, m.start()) + 1
            marks = [pytest.mark.slow] if "slow" in words[2:] else []
            params.append(pytest.param(lang, m.group(2), id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    return params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("lang,code", _blocks())
def test_runnable_block(lang: str, code: str):
    for shared in sorted(set(re.findall(r"\.\./shared/[\w./-]+", code))):
        if not (ROOT / shared).exists():
            pytest.skip(f"{shared} is not beside the repository")
    if lang == "bash" and re.search(r"(^|\s)curl\s", code) and shutil.which("curl") is None:
        pytest.skip("the block calls curl, which is not installed")
    port = _free_port()
    code = code.replace(f":{EXAMPLE_PORT}", f":{port}").replace(f"--port {EXAMPLE_PORT}", f"--port {port}")
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # Output goes to a file, not a pipe: a server the block left running would hold a pipe open.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the block ran past {BLOCK_TIMEOUT_S} s")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the block left running in its group
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        out = log.read()
    assert proc.returncode == 0, f"exit {proc.returncode}; output:\n{out[-4000:]}"


def test_docs_have_runnable_blocks():
    """The README's Python and serve examples are among the blocks run (the marker was not lost)."""
    ids = [p.id for p in _blocks()]
    assert sum(i.startswith("README.md:") for i in ids) >= 2, ids


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    problems = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            if rel not in PENDING_PAGES:
                problems.append(f"{target}: {rel} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {rel}")
    assert not problems, f"{doc.relative_to(ROOT)}: " + "; ".join(problems)


SHELL_OPS = {"|", "||", "&&", ";", "&"}


def _shell_commands(doc: Path) -> list[tuple[int, list[str]]]:
    """(line, words) of every command in the doc's bash blocks and its inline `kvtier ...` spans."""
    text = doc.read_text()
    commands = []
    for m in FENCE.finditer(text):
        if m.group(1).split()[:1] != ["bash"]:
            continue
        first = text.count("\n", 0, m.start()) + 2
        body = m.group(2).replace("\\\n", " ")
        pending, start = "", 0
        for n, line in enumerate(body.split("\n")):
            line = re.sub(r"(^|\s)#.*", "", line) if not pending else line
            pending, start = (pending + "\n" + line, start) if pending else (line, first + n)
            try:
                words = shlex.split(pending)
            except ValueError:  # a quoted string that goes on on the next line
                continue
            if words:
                commands.append((start, words))
            pending = ""
        assert not pending, f"{doc.name}:{start}: unterminated quote"
    for m in re.finditer(r"`(kvtier [a-z][^`]*)`", FENCE.sub("", text)):
        commands.append((text.count("\n", 0, text.find(m.group(0))) + 1, shlex.split(m.group(1))))
    return commands


_HELP: dict[str, str | None] = {}


def _kvtier_help(sub: str) -> str | None:
    """``kvtier SUB --help`` as printed, or None when SUB is not a subcommand (one import for all)."""
    cache = _HELP
    if sub not in cache:
        from importlib.metadata import entry_points

        main = next(e for e in entry_points(group="console_scripts") if e.name == "kvtier").load()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([sub, "--help"])
            except SystemExit as e:
                cache[sub] = out.getvalue() if e.code == 0 else None
    return cache[sub]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_name_real_subcommands_flags_and_scripts(doc: Path, monkeypatch):
    """Every `kvtier SUB --flag` a doc shows is a subcommand with that flag, and every script it
    runs (`python perf/x.py`, `bash hip/x.sh`, `scripts/x.sh`) is in the repository."""
    monkeypatch.setenv("COLUMNS", "200")
    problems = []
    for line, words in _shell_commands(doc):
        for i, word in enumerate(words):
            if word == "kvtier" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                sub, help_text = words[i + 1], _kvtier_help(words[i + 1])
                if help_text is None:
                    problems.append(f"line {line}: kvtier {sub} is not a subcommand")
                    continue
                for arg in words[i + 2:]:
                    if arg in SHELL_OPS:
                        break
                    flag = arg.split("=", 1)[0]
                    if flag.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                        problems.append(f"line {line}: kvtier {sub} has no {flag}")
            elif re.fullmatch(r"(perf|scripts|hip|tests)/[\w/.-]+\.(py|sh)", word) and not (ROOT / word).is_file():
                problems.append(f"line {line}: {word} does not exist")
    assert not problems, f"{doc.relative_to(ROOT)}: " + "; ".join(problems)


# The design notes kept beside the repository while it was developed; the package, its tests and
# its docs cite docs/ instead.
OUTSIDE = re.compile(r"shared/docs|\b(?:DESIGN|WORKLOAD|STORES|KIMI|STYLE)\.md\b")
CHECKED = ["python", "tests", "perf", "scripts", "hip", "triton_kernels", "docs", "README.md"]


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *CHECKED],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{n}: {line.strip()}")
    assert not hits, "references to notes outside the repository:\n" + "\n".join(hits)
