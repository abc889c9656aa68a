"""The `relaytrain` command line: `plan` and `run --local`.

Each subcommand lives in its own module and is imported only when it runs, so
`relaytrain plan` starts without loading what `run` needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytrain",
        description="Fine-tune LLMs across mixed GPUs joined by ordinary networks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from relaytrain_operator import plan_cmd

    plan_cmd.add_parser(sub)

    from relaytrain_operator import local_run

    local_run.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
