"""The `relaytrain` command line: `plan` and `run --local`.

Each subcommand lives in its own module and is imported only when it runs, so
`relaytrain plan` starts without loading what `run` needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Literal


def positive_int(raw: str) -> int:
    """An argparse type: a positive integer, else an error that shows what was given."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {raw!r}")
    return value


def replicas(raw: str) -> int | Literal["auto"]:
    """An argparse type for ``--replicas``: 'auto' or a positive integer."""
    if raw == "auto":
        return "auto"
    try:
        return positive_int(raw)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a positive integer, got {raw!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytrain",
        description="Fine-tune LLMs across mixed GPUs joined by ordinary networks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from relaytrain_operator.cli import plan_cmd

    plan_cmd.add_parser(sub)

    from relaytrain_operator.cli import local_run

    local_run.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
