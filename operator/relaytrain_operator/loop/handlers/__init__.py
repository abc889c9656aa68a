"""kopf handlers: thin glue from kopf's events to `relaytrain_operator.loop.runner`.

Importing this package registers them (with kopf's default registry); __main__ imports it
after the options are parsed.
"""

from relaytrain_operator.loop.handlers import indexes, jobs, nodes, pods, startup

__all__ = ["indexes", "jobs", "nodes", "pods", "startup"]
