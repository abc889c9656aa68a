"""`python -m relaytrain_operator`: run the operator (kopf with our handlers)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import kopf
from relaytrain_contract.stacks import dump_stacks_on_sigusr1

from relaytrain_operator.loop.options import parse_options


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    # `kill -USR1 <pid>` prints every thread's stack: how to see what a stuck operator waits on.
    dump_stacks_on_sigusr1()
    kopf.configure(log_format=kopf.LogFormat.FULL, verbose=False, debug=opts.debug)
    if not opts.debug:
        logging.getLogger("kubernetes").setLevel(logging.WARNING)
        # kopf logs every handler run at INFO; ours log what they change.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # The liveness server's access log: a line for every probe, several a second, which
        # buries what the operator did (`kubectl logs` shows the last of it).
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Registers the handlers (importing them needs kopf and the kubernetes client, which
    # `--help` does not).
    import relaytrain_operator.loop.handlers

    if opts.kueue:
        # Only then: watching a resource the operator may not list would fail forever.
        import relaytrain_operator.loop.handlers.workloads  # noqa: F401

    # Plain names are watched one by one (loop/handlers/startup.py); globs are served by
    # watching the cluster and filtering each handler by namespace (handlers/filters.py),
    # never by kopf's namespace scan, whose list and watch leave a gap (a namespace made
    # between them is never served).
    cluster = not opts.patterns or opts.globbed
    kopf.run(
        clusterwide=cluster,
        namespaces=[] if cluster else list(opts.patterns),
        liveness_endpoint=opts.liveness_endpoint,
        memo=kopf.Memo(options=opts),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
