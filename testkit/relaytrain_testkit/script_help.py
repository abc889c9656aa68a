"""`script --help` for many Python scripts at the cost of one torch import.

Run as a program (`python script_help.py MODULES -- SCRIPT...`; stdlib only, so it needs
nothing on the path): it imports MODULES (comma-separated, e.g. `torch`), then forks one child
per script, which runs it as `python SCRIPT --help` would (`__main__`, its folder first on
`sys.path`, its own argv) with its output in a file of its own, and prints one JSON object:
each script's exit status and output. A child shares only the imported MODULES with its
siblings, so a script that would fail alone fails here too; what it saves is the seconds
each fresh interpreter spends importing torch before it parses its options (twelve bench
scripts took 47 s in the unit tier, two at a time).

`helps()` is the caller's side.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path


def helps(
    python: str, scripts: Iterable[str], preload: Iterable[str], env: Mapping[str, str], cwd: Path,
    timeout: float = 300,
) -> dict[str, tuple[int, str]]:  # fmt: skip
    """(exit status, output) of `python SCRIPT --help` for each of `scripts` (paths relative
    to `cwd`), `preload` imported once before any of them runs."""
    args = [python, __file__, ",".join(preload), "--", *scripts]
    done = subprocess.run(
        args, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    found: dict[str, list[object]] = json.loads(done.stdout)
    return {script: (int(str(rc)), str(out)) for script, (rc, out) in found.items()}


def _run_child(script: str, out_path: str) -> int:
    """In the child: `script --help`, its output to `out_path`; its exit status."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script, "--help"]
    sys.path[0] = str(Path(script).resolve().parent)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main(argv: list[str]) -> int:
    preload, sep, *scripts = argv
    if sep != "--":
        print("usage: script_help.py MODULES -- SCRIPT...", file=sys.stderr)
        return 2
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    results: dict[str, list[object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, script in enumerate(scripts):
            out_path = os.path.join(tmp, f"{i}.out")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child never returns into this loop
                os._exit(_run_child(script, out_path))
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
            results[script] = [rc, Path(out_path).read_text(errors="replace")]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
