"""`python -m relaytrain_worker --config PATH` (or the document in RELAYTRAIN_STAGE_CONFIG)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from relaytrain_contract import CONFIG_ENV as ENV


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # SIGTERM while loading, or while closing links once done
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaytrain_worker")
    parser.add_argument("--config", type=Path, help=f"stage config JSON (default: ${ENV})")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RELAYTRAIN_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
        print(f"relaytrain-worker: invalid stage config: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (pod deletion, Ctrl-C of `relaytrain run --local`) exits like Ctrl-C.
    signal.signal(signal.SIGTERM, _terminate)

    from relaytrain_worker.model.shards import ModelLoadError
    from relaytrain_worker.pipeline.linkauth import AuthError
    from relaytrain_worker.process import load_runtime
    from relaytrain_worker.state.records import DataError

    try:
        runtime = load_runtime(cfg)
    except (ModelLoadError, DataError) as exc:
        print(f"relaytrain-worker: stage {cfg.stage.index}: {exc}", file=sys.stderr)
        return 3
    except AuthError as exc:
        print(
            f"relaytrain-worker: stage {cfg.stage.index}: link credentials: {exc}", file=sys.stderr
        )
        return 4
    try:
        return runtime.run()
    except AuthError as exc:
        print(f"relaytrain-worker: stage {cfg.stage.index}: link refused: {exc}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        logging.getLogger("relaytrain.stage").info("Stage %d stopped", cfg.stage.index)
        return 130
    finally:
        # The outcome is decided: a SIGTERM from here on (the pod deleted once the job is
        # done) ends the process as any program's, never as an uncaught KeyboardInterrupt.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        runtime.close()


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
