"""`python -m relaytrain_worker --config PATH` (or the document in RELAYTRAIN_STAGE_CONFIG)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from relaytrain_contract import CONFIG_ENV as ENV
from relaytrain_contract.exits import MESSAGE_LIMIT, TERMINATION_LOG, TERMINATION_LOG_ENV, StageExit
from relaytrain_contract.stacks import dump_stacks_on_sigusr1


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


class _OnSigterm:
    """SIGTERM once training: a stage of several pipelines leaves at the next step boundary
    (`depart`, the runtime's `Replication.depart` once it is loaded); otherwise, or at a
    second SIGTERM, it stops at once. `leaving`: it chose to leave at its step boundary."""

    def __init__(self) -> None:
        self.depart: Callable[[], bool] = lambda: False
        self.leaving = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.depart():
            _terminate(signum, frame)
        self.leaving = True


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # SIGTERM while loading, or while closing links once done
        return StageExit.STOPPED


def stop(code: StageExit, line: str) -> int:
    """End the stage on `line`: one line on stderr and in the container's termination
    message (relaytrain_contract.exits), which the operator quotes in the job's condition.
    Returns `code`."""
    text = f"relaytrain-worker: {line}"
    print(text, file=sys.stderr)
    path = os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG
    try:  # a kubelet provides the file; elsewhere (a shell, run --local) there is none
        if os.environ.get(TERMINATION_LOG_ENV) or os.path.exists(path):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.encode()[:MESSAGE_LIMIT].decode(errors="ignore"))
    except OSError:
        pass
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaytrain_worker")
    parser.add_argument("--config", type=Path, help=f"stage config JSON (default: ${ENV})")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RELAYTRAIN_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # A stage that dies of a fatal signal (a native crash in torch or a link thread) leaves
    # every thread's stack in its log instead of ending without a word.
    faulthandler.enable(all_threads=True)
    # `kill -USR1` (or `kubectl exec ... kill -USR1 1`) writes them too, and the stage goes on:
    # where a hung stage waits.
    dump_stacks_on_sigusr1()
    from relaytrain_contract import ConfigError, StageConfig

    if args.config is not None:
        document = args.config.read_text()
    elif os.environ.get(ENV):
        document = os.environ[ENV]
    else:
        parser.error(f"give --config PATH or set {ENV}")
    try:
        cfg = StageConfig.from_json(document)
    except ConfigError as exc:
        return stop(StageExit.INVALID_CONFIG, f"invalid stage config: {exc}")
    name = str(cfg.stage.index)
    if cfg.replicas is not None:
        name = f"p{cfg.replicas.pipeline}/s{cfg.stage.index}"
    where = f"stage {name}"
    # SIGTERM (pod deletion, Ctrl-C of `relaytrain run --local`) exits like Ctrl-C, and in
    # a bounded time even where the main thread does not act on it (stopping.py).
    on_sigterm = _OnSigterm()
    signal.signal(signal.SIGTERM, on_sigterm)
    from relaytrain_worker.stopping import watch_sigterm

    watch_sigterm(name, lambda: on_sigterm.leaving)
    if cfg.method.type != "qlora":
        # Only QLoRA's NF4 base uses bitsandbytes, but peft imports it whenever it is
        # installed: about a second of CPU at every stage start (and restart). A None entry
        # in sys.modules makes it absent to find_spec and to import alike.
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]

    from relaytrain_worker.model.shards import ModelLoadError
    from relaytrain_worker.pipeline.device import DeviceError
    from relaytrain_worker.pipeline.linkauth import AuthError, PlanReplaced
    from relaytrain_worker.pipeline.replication import DepartedError
    from relaytrain_worker.process import load_runtime
    from relaytrain_worker.state.fence import SupersededError
    from relaytrain_worker.state.records import DataError

    try:
        runtime = load_runtime(cfg)
    except (ModelLoadError, DataError) as exc:
        return stop(StageExit.INVALID_INPUT, f"{where}: {exc}")
    except AuthError as exc:
        return stop(StageExit.LINK_REFUSED, f"{where}: link credentials: {exc}")
    except DeviceError as exc:
        # A value that is no device is the operator's to fix; a GPU the container does not
        # see may be this node's alone, so a replacement elsewhere is worth its try.
        return stop(
            StageExit.INVALID_CONFIG if exc.invalid else StageExit.FAILED, f"{where}: {exc}"
        )
    except Exception as exc:
        return _store_failure(where, exc)
    on_sigterm.depart = runtime.replication.depart
    try:
        return runtime.run()
    except DepartedError as exc:
        logging.getLogger("relaytrain.stage").info("%s", exc)
        return StageExit.STOPPED
    except SupersededError as exc:  # a stage of a replaced plan, still running: it ends
        return stop(StageExit.STOPPED, f"{where}: {exc}")
    except PlanReplaced as exc:  # the same, found out on a link
        return stop(StageExit.STOPPED, f"{where}: it stops: {exc}")
    except AuthError as exc:
        return stop(StageExit.LINK_REFUSED, f"{where}: link refused: {exc}")
    except KeyboardInterrupt:
        logging.getLogger("relaytrain.stage").info("Stage %d stopped", cfg.stage.index)
        return StageExit.STOPPED
    except (ModelLoadError, DataError) as exc:  # a held-out file read at its first pass
        return stop(StageExit.INVALID_INPUT, f"{where}: {exc}")
    except Exception as exc:
        return _store_failure(where, exc)
    finally:
        # The outcome is decided: a SIGTERM from here on (the pod deleted once the job is
        # done) ends the process as any program's, never as an uncaught KeyboardInterrupt.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        runtime.close()


def _store_failure(where: str, exc: Exception) -> int:
    """A store error as one line and its code (the store's refusal is not retried; an
    outage past the store's retries is); any other error goes up as the crash it is."""
    from relaytrain_worker.state.store import StoreError, refusal

    refused = refusal(exc)
    if refused is not None:
        return stop(StageExit.STORE_REFUSED, f"{where}: {refused}")
    if isinstance(exc, StoreError):
        return stop(StageExit.FAILED, f"{where}: {exc}")
    raise exc


def _exit(code: int) -> None:
    """End the process with `code` once its outcome is decided, without the interpreter's
    teardown: daemon threads (replica relinks, link readers, the metrics server) may still
    be inside native code, and tearing torch down under them can abort the process
    ("terminate called without an active exception", SIGABRT) after a stage that finished
    well — which the operator would read as a failed stage."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
