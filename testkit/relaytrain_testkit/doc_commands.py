"""The shell commands of README.md and docs/*.md, and the registry of how each is tested.

A command is a line of a fenced ```bash, ```sh, ```shell or ```console block (in a console
block, a line starting with `$ `), with backslash continuations joined, blank lines and
comments skipped and a trailing comment removed. docs/commands.yaml lists each one once,
with how a test runs it; tests/unit/test_doc_commands.py checks that the two agree and
runs the unit-tier commands, tests/k8s/test_doc_commands_cluster.py the cluster ones.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relaytrain_testkit import REPO

REGISTRY = REPO / "docs" / "commands.yaml"
SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console"})
RUN_MODES = frozenset({"unit", "cluster", "bench", "dry-run"})
ENTRY_KEYS = frozenset(
    {"command", "run", "covered_by", "prints", "never_prints", "exit", "then", "background",
     "why"}
)  # fmt: skip
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def doc_files() -> list[Path]:
    """README.md and every docs/*.md page."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """A fenced code block of a Markdown file."""

    path: str
    """The file, relative to the repository."""
    line: int
    """Line number of the opening fence."""
    language: str
    """The info string's first word ('' when none)."""
    lines: tuple[str, ...]
    """The block's lines, fences excluded."""


@dataclass(frozen=True)
class DocCommand:
    """One shell command as a doc shows it."""

    text: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def fenced_blocks(text: str, path: str) -> list[Block]:
    """Every fenced block of a Markdown text."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, language, start = match.group(2), match.group(3).lower(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start + 1, language, tuple(body)))
        i += 1
    return blocks


def strip_comment(line: str) -> str:
    """`line` without a trailing shell comment (a `#` starting a word, outside quotes)."""
    quote = ""
    escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(block: Block) -> list[DocCommand]:
    """The commands of a shell block (none for other languages)."""
    if block.language not in SHELL_LANGUAGES:
        return []
    commands: list[DocCommand] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(block.lines):
        number = block.line + 1 + offset
        if pending:
            line = raw.strip()
        elif block.language == "console":
            if not raw.lstrip().startswith("$ "):
                continue  # output, not a command
            line, start = raw.lstrip()[2:].strip(), number
        else:
            line, start = raw.strip(), number
            if not line or line.startswith("#"):
                continue
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        text = strip_comment(" ".join([*pending, line]).strip())
        pending = []
        if text:
            commands.append(DocCommand(text, block.path, start))
    if pending:
        commands.append(DocCommand(strip_comment(" ".join(pending)), block.path, start))
    return commands


def doc_blocks(paths: list[Path] | None = None) -> list[Block]:
    """Every fenced block of the docs, in file order."""
    blocks: list[Block] = []
    for path in paths or doc_files():
        blocks += fenced_blocks(path.read_text(), str(path.relative_to(REPO)))
    return blocks


def doc_commands(paths: list[Path] | None = None) -> list[DocCommand]:
    """Every command of the docs' shell blocks, in file order."""
    return [c for b in doc_blocks(paths) for c in block_commands(b)]


# --- the registry ------------------------------------------------------------------


class RegistryError(ValueError):
    """docs/commands.yaml is malformed; the message lists every problem."""


@dataclass(frozen=True)
class Entry:
    """How one documented command is tested (see docs/commands.yaml's header)."""

    command: str
    run: tuple[str, ...] = ()
    covered_by: tuple[str, ...] = ()
    prints: tuple[str, ...] = ()
    never_prints: tuple[str, ...] = ()
    exit: int = 0
    then: str | None = None
    background: bool = False
    why: str = ""


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in items):
        raise TypeError(f"expected a string or a list of strings, got {value!r}")
    return tuple(items)


def _entry(raw: Any) -> Entry:
    if not isinstance(raw, dict) or not isinstance(raw.get("command"), str):
        raise TypeError("each entry is a mapping with a `command` string")
    unknown = set(raw) - ENTRY_KEYS
    if unknown:
        raise TypeError(f"unknown keys {sorted(unknown)}")
    entry = Entry(
        command=raw["command"],
        run=_strings(raw.get("run")),
        covered_by=_strings(raw.get("covered_by")),
        prints=_strings(raw.get("prints")),
        never_prints=_strings(raw.get("never_prints")),
        exit=int(raw.get("exit", 0)),
        then=raw.get("then"),
        background=bool(raw.get("background", False)),
        why=str(raw.get("why", "")),
    )
    problems = []
    if bool(entry.run) == bool(entry.covered_by):
        problems.append("give exactly one of `run` and `covered_by`")
    if set(entry.run) - RUN_MODES:
        problems.append(f"`run` must be among {sorted(RUN_MODES)}")
    if set(entry.run) & {"unit", "cluster", "dry-run"} and not entry.prints:
        problems.append("a command a test runs needs `prints` (what its output must contain)")
    if "dry-run" in entry.run and not entry.command.startswith("make "):
        problems.append("`dry-run` is for make targets (make -n)")
    if "bench" in entry.run and not re.search(r"\bbench/\w+\.py\b", entry.command):
        problems.append("`bench` is for bench/*.py scripts")
    if entry.background and entry.then is None:
        problems.append("a `background` command needs `then` (what to check while it runs)")
    if problems:
        raise TypeError("; ".join(problems))
    return entry


def load_registry(path: Path = REGISTRY) -> list[Entry]:
    """The registry's entries; RegistryError names every malformed or duplicated one."""
    doc = yaml.safe_load(path.read_text())
    raws = doc.get("commands") if isinstance(doc, dict) else None
    if not isinstance(raws, list):
        raise RegistryError(f"{path.name}: expected a top-level `commands:` list")
    entries: list[Entry] = []
    problems: list[str] = []
    seen: set[str] = set()
    for i, raw in enumerate(raws):
        try:
            entry = _entry(raw)
        except (TypeError, ValueError) as err:
            problems.append(f"entry {i} ({(raw or {}).get('command')!r}): {err}")
            continue
        if entry.command in seen:
            problems.append(f"entry {i}: {entry.command!r} is listed twice")
        seen.add(entry.command)
        entries.append(entry)
    if problems:
        raise RegistryError("\n".join(problems))
    return entries


def unregistered(commands: list[DocCommand], entries: list[Entry]) -> list[DocCommand]:
    """Documented commands the registry does not list."""
    known = {e.command for e in entries}
    return [c for c in commands if c.text not in known]


def undocumented(commands: list[DocCommand], entries: list[Entry]) -> list[Entry]:
    """Registry entries whose command no doc shows any more."""
    shown = {c.text for c in commands}
    return [e for e in entries if e.command not in shown]


def missing_targets(entry: Entry) -> list[str]:
    """The `covered_by` targets of `entry` that do not exist: `path` (a glob) or `path::test`."""
    missing = []
    for target in entry.covered_by:
        pattern, _, name = target.partition("::")
        files = sorted(glob.glob(str(REPO / pattern)))
        if not files:
            missing.append(f"{target}: no file matches {pattern}")
        elif name and not any(re.search(rf"^def {re.escape(name)}\(", Path(f).read_text(), re.M)
                              for f in files):  # fmt: skip
            missing.append(f"{target}: no test function {name} in {pattern}")
    return missing


def by_command() -> dict[str, Entry]:
    return {e.command: e for e in load_registry()}


# --- running commands as written ---------------------------------------------------


@dataclass(frozen=True)
class Result:
    rc: int
    output: str


class Shell:
    """A bash session: each command runs in `cwd`, and what it sets or exports (`export X=`,
    `VAR=...`, `source .venv/bin/activate`) carries over to the next, as at a prompt."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self.env = dict(env)
        self.cwd = cwd

    def run(self, command: str, timeout: float, then: str | None = None) -> Result:
        """Runs `command` (then `then`, whose output is added); the status is `command`'s."""
        with tempfile.TemporaryDirectory() as tmp:
            env_file = Path(tmp) / "env"
            script = f"set -a\n{command}\n__rt_rc=$?\n{then or ''}\nenv -0 > {env_file}\n"
            script += "exit $__rt_rc\n"
            done = subprocess.run(
                ["bash", "-c", script], cwd=self.cwd, env=self.env, timeout=timeout,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
            )  # fmt: skip
            if env_file.is_file():
                pairs = [p.split("=", 1) for p in env_file.read_text().split("\0") if "=" in p]
                self.env = {k: v for k, v in pairs if k not in ("_", "SHLVL", "OLDPWD", "__rt_rc")}
        return Result(done.returncode, done.stdout)

    def run_background(self, command: str, then: str, timeout: float) -> Result:
        """Starts `command`, runs `then` while it runs, stops it with SIGTERM; the output of
        both. The status is `then`'s, or 125 when `command` exited before `then` finished."""
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=self.cwd, env=self.env, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.extend(proc.stdout or []), daemon=True)
        reader.start()
        try:
            checked = self.run(then, timeout=timeout)
            still_running = proc.poll() is None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            reader.join(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        rc = checked.rc if still_running else 125
        return Result(rc, "".join(chunks) + checked.output)


UNIT_TIMEOUT = 120
"""Seconds a unit-tier command may take."""


def run_unit(entry: Entry, scratch: Path) -> Result:
    """Runs a unit-tier command (and its `then`) as a fresh shell in the repository would, with
    an empty Hugging Face cache under `scratch`, so that nothing it needs comes from a hub."""
    env = clean_env(HF_HUB_CACHE=str(scratch / "empty-hf-cache"))
    return Shell(env, REPO).run(entry.command, timeout=UNIT_TIMEOUT, then=entry.then)


class RunAhead:
    """The unit-tier commands a test session has selected, started as soon as it has collected
    them: one at a time, in the session's order, on a background thread. pytest runs one test
    at a time, so a second core sits idle; these are 16 s of subprocesses (`relaytrain plan`,
    the decision module's coverage run, the time-to-loss model), a quarter of `make
    test-fast`, which now run while the tests before them do. Each test still checks its own
    command's result (`result`), and runs the command itself where nothing started it."""

    def __init__(self) -> None:
        self._started: dict[str, Future[Result]] = {}

    def start(self, entries: Iterable[Entry]) -> None:
        pending = [(e, Future[Result]()) for e in entries if e.command not in self._started]
        self._started.update((entry.command, future) for entry, future in pending)
        if pending:
            threading.Thread(
                target=self._work, args=(pending,), name="doc-commands-ahead", daemon=True
            ).start()

    @staticmethod
    def _work(pending: list[tuple[Entry, Future[Result]]]) -> None:
        for entry, future in pending:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with tempfile.TemporaryDirectory() as scratch:
                    future.set_result(run_unit(entry, Path(scratch)))
            except BaseException as exc:  # handed to the test that waits for it
                future.set_exception(exc)

    def result(self, entry: Entry, scratch: Path) -> Result:
        """`entry`'s result: the one started ahead, or (where none was) run now."""
        future = self._started.get(entry.command)
        return future.result() if future is not None else run_unit(entry, scratch)


AHEAD = RunAhead()
"""The session's commands run ahead (tests/conftest.py starts them after collection)."""


def venv_bin() -> Path:
    """The bin folder of the virtualenv running the tests (the repo's .venv under make)."""
    return Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment as a fresh shell would have it: no active virtualenv,
    cluster, S3 or Hugging Face settings, no outer make's flags, no test session's prefork
    server; the virtualenv's bin first on PATH."""
    drop = ("VIRTUAL_ENV", "KUBECONFIG", "PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL",
            "RELAYTRAIN_PREFORK_SOCKET")  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("AWS_", "HF_", "HUGGINGFACE_"))
    }
    env["PATH"] = os.pathsep.join([str(venv_bin()), env.get("PATH", "")])
    env.update(extra)
    return env


def check(entry: Entry, result: Result) -> list[str]:
    """What is wrong with `result` for `entry` (empty: as expected)."""
    problems = []
    if result.rc != entry.exit:
        problems.append(f"exit status {result.rc}, expected {entry.exit}")
    problems += [f"output lacks {text!r}" for text in entry.prints if text not in result.output]
    problems += [f"output has {text!r}" for text in entry.never_prints if text in result.output]
    return problems
