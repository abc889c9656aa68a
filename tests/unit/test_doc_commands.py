"""Every command the README and docs/ show is registered in docs/commands.yaml with the test
that runs it, and the unit-tier ones run as written and print what they should."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from relaytrain_testkit.doc_commands import (
    AHEAD,
    REGISTRY,
    REPO,
    SHELL_LANGUAGES,
    Entry,
    RegistryError,
    Result,
    RunAhead,
    block_commands,
    check,
    clean_env,
    doc_blocks,
    doc_commands,
    fenced_blocks,
    load_registry,
    missing_targets,
    undocumented,
    unregistered,
    venv_bin,
)
from relaytrain_testkit.script_help import helps
from relaytrain_testkit.tiers import needs_torch

pytestmark = pytest.mark.unit

ENTRIES = load_registry()


def _entries(mode: str) -> list[Entry]:
    return [e for e in ENTRIES if mode in e.run]


def _id(entry: Entry) -> str:
    return entry.command[:70]


def _bench_entries() -> list[object]:
    """Bench commands, marked `torch` where the script imports it (make test-fast skips them)."""
    params: list[object] = []
    for entry in _entries("bench"):
        marks = [pytest.mark.torch] if _imports_torch(entry) else []
        params.append(pytest.param(entry, marks=marks, id=_id(entry)))
    return params


SAMPLE = """\
Some prose.

```bash
make cluster-up   # start it
# a comment line
export KUBECONFIG=$(make -s kubeconfig)
helm template rt charts/relaytrain \\
  --set a=b \\
  | kubectl apply -f -
echo '# not a comment' "# nor this" a#b
```

```console
$ kubectl get ftj      # what it shows
NAME    PHASE
$ relaytrain plan a.yaml \\
      --json
{"not": "a command"}
```

```text
$ not a shell block
```
"""


def test_commands_are_lines_of_shell_blocks_with_continuations_joined_and_comments_dropped():
    blocks = fenced_blocks(SAMPLE, "SAMPLE.md")
    assert [b.language for b in blocks] == ["bash", "console", "text"]
    assert [(c.text, c.line) for b in blocks for c in block_commands(b)] == [
        ("make cluster-up", 4),
        ("export KUBECONFIG=$(make -s kubeconfig)", 6),
        ("helm template rt charts/relaytrain --set a=b | kubectl apply -f -", 7),
        ("echo '# not a comment' \"# nor this\" a#b", 10),
        ("kubectl get ftj", 14),
        ("relaytrain plan a.yaml --json", 16),
    ]


def test_every_fenced_block_names_its_language():
    """So a command cannot hide in an unlabelled block: shell blocks say bash/sh/shell/console,
    others text, yaml, json, python..."""
    unlabelled = [f"{b.path}:{b.line}" for b in doc_blocks() if not b.language]
    assert unlabelled == [], "give these fenced blocks a language: " + ", ".join(unlabelled)


def test_the_docs_have_shell_blocks():
    assert {b.language for b in doc_blocks()} & SHELL_LANGUAGES
    assert len(doc_commands()) >= 20


def test_every_documented_command_is_registered():
    missing = unregistered(doc_commands(), ENTRIES)
    assert missing == [], f"add these to {REGISTRY.relative_to(REPO)}:\n" + "\n".join(
        f"  {c.where()}: {c.text}" for c in missing
    )


def test_every_registered_command_is_still_in_the_docs():
    stale = undocumented(doc_commands(), ENTRIES)
    assert stale == [], "no doc shows these any more; remove them from the registry:\n" + "\n".join(
        f"  {e.command}" for e in stale
    )


def test_a_command_added_to_a_doc_without_an_entry_fails_the_check(tmp_path):
    readme = (REPO / "README.md").read_text()
    page = tmp_path / "README.md"
    page.write_text(readme + "\n```bash\nrelaytrain plan new.yaml --nodes n.yaml\n```\n")
    blocks = fenced_blocks(page.read_text(), "README.md")
    added = [c for b in blocks for c in block_commands(b)]
    assert [c.text for c in unregistered(added, ENTRIES)] == [
        "relaytrain plan new.yaml --nodes n.yaml"
    ]


def test_a_malformed_registry_is_refused(tmp_path):
    bad = tmp_path / "commands.yaml"
    bad.write_text(
        "commands:\n"
        "  - {command: a, run: unit}\n"  # no prints: a check that cannot fail
        "  - {command: b, run: unit, covered_by: x.py, prints: [x]}\n"
        "  - {command: c, run: someday}\n"
        "  - {command: d, covered_by: x.py, colour: red}\n"
        "  - {command: e, covered_by: x.py}\n"
        "  - {command: e, covered_by: x.py}\n"
    )
    with pytest.raises(RegistryError) as err:
        load_registry(bad)
    message = str(err.value)
    for expected in ("entry 0", "entry 1", "entry 2", "entry 3", "'e' is listed twice"):
        assert expected in message


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.covered_by], ids=_id)
def test_covered_by_names_tests_that_exist(entry):
    assert missing_targets(entry) == []


def test_a_missing_covered_by_target_is_reported():
    entry = Entry("make demo", covered_by=("tests/e2e/test_doc_commands_e2e.py::test_nope",))
    assert missing_targets(entry) == [
        "tests/e2e/test_doc_commands_e2e.py::test_nope: no test function test_nope in "
        "tests/e2e/test_doc_commands_e2e.py"
    ]
    assert missing_targets(Entry("x", covered_by=("tests/nope_*.py",))) != []


@pytest.mark.parametrize(
    "entry", [e for e in ENTRIES if "-m pytest" in e.command and e.covered_by], ids=_id
)
def test_a_pytest_command_is_covered_by_the_tests_it_names(entry):
    """A pytest command the test session does not run again is covered by what it names."""
    named = [a for a in shlex.split(entry.command) if a.startswith("tests/")]
    assert sorted(entry.covered_by) == sorted(named)


@pytest.mark.parametrize("entry", _entries("unit"), ids=_id)
def test_unit_command_runs_as_written(entry, tmp_path):
    """Each command runs in a fresh shell; the session starts them ahead (`AHEAD`)."""
    result = AHEAD.result(entry, tmp_path)
    assert check(entry, result) == [], result.output


def test_commands_run_ahead_give_each_test_its_own_result_and_the_rest_run_when_asked(tmp_path):
    """What RunAhead started is what the test gets, whatever order it is asked in; a command
    it did not start runs when asked, in the test."""
    marker = tmp_path / "ran"
    slow = Entry(f"sleep 0.2; echo first >> {marker}; echo one", run=("unit",))
    failing = Entry(f"echo second >> {marker}; echo two; exit 3", run=("unit",))
    later = Entry(f"echo third >> {marker}; echo three", run=("unit",))
    ahead = RunAhead()
    ahead.start([slow, failing])
    assert ahead.result(failing, tmp_path) == Result(3, "two\n")
    assert ahead.result(slow, tmp_path) == Result(0, "one\n")
    assert marker.read_text() == "first\nsecond\n"  # one at a time, in the order given
    assert ahead.result(later, tmp_path) == Result(0, "three\n")
    assert marker.read_text() == "first\nsecond\nthird\n"


def _imports_torch(entry: Entry) -> bool:
    return needs_torch(next(REPO / a for a in shlex.split(entry.command) if a.endswith(".py")))


def _script(entry: Entry) -> str:
    """The command up to its bench/*.py."""
    found = re.match(r".*?\bbench/\w+\.py\b", entry.command)
    assert found is not None, entry.command
    return found.group(0)


TORCH_PRELOAD = ["torch", "relaytrain_worker.pipeline.stage"]
"""What the torch bench scripts' --help runs import first, once: torch, and the worker's
stage with transformers, peft and bitsandbytes (26 s for twelve scripts with torch alone,
9 s with these)."""


@functools.cache
def _bench_helps(torch: bool) -> dict[str, Result]:
    """`script --help` of every bench script that imports torch (or, `torch` False, does
    not), by their command up to the script: each forked from one interpreter that imported
    torch once (`script_help`, `TORCH_PRELOAD`), which saves the seconds a fresh one spends
    on it before it parses; make test-fast asks only for those that do not."""
    commands = sorted({_script(e) for e in _entries("bench") if _imports_torch(e) == torch})
    paths = {c: next(a for a in shlex.split(c) if a.endswith(".py")) for c in commands}
    preload = TORCH_PRELOAD if torch else []
    found = helps(str(venv_bin() / "python"), paths.values(), preload, clean_env(), REPO)
    return {c: Result(*found[path]) for c, path in paths.items()}


@pytest.mark.parametrize("entry", _bench_entries())
def test_bench_command_passes_options_the_script_takes(entry, tmp_path):
    result = _bench_helps(_imports_torch(entry))[_script(entry)]
    assert result.rc == 0, result.output
    assert "usage:" in result.output
    options = re.findall(r"(?<!\S)(--[\w-]+)", entry.command)
    assert [o for o in options if o not in result.output] == [], result.output


def test_make_bench_runs_every_bench_script():
    """`run: bench` means `make bench` runs it: hack/bench.sh loops over bench/bench_*.py."""
    script = (REPO / "hack" / "bench.sh").read_text()
    assert "for b in bench/bench_*.py" in script and "bench/bench_operator.py" in script
    for entry in _entries("bench"):
        (path,) = re.findall(r"\bbench/\w+\.py\b", entry.command)
        assert Path(REPO / path).is_file() and Path(path).name.startswith("bench_")


@pytest.mark.parametrize("entry", _entries("dry-run"), ids=_id)
def test_make_target_would_run_what_the_registry_says(entry):
    args = shlex.split(entry.command)[1:]
    done = subprocess.run(
        ["make", "-n", *args], cwd=REPO, env=clean_env(), capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [t for t in entry.prints if t not in output] == [], output


def test_check_reports_a_wrong_status_missing_and_forbidden_output():
    entry = Entry("x", run=("unit",), prints=("Plan for",), never_prints=("Traceback",))
    assert check(entry, Result(0, "Plan for job")) == []
    assert check(entry, Result(2, "Traceback (most recent call last)")) == [
        "exit status 2, expected 0",
        "output lacks 'Plan for'",
        "output has 'Traceback'",
    ]
