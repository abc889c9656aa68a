"""kopf handlers: thin glue from kopf's events to `relaytrain_operator.reconcile`.

Importing this package registers them (with kopf's default registry); __main__ imports it
after the options are parsed, because the periodic check's interval is one of them.
"""

from relaytrain_operator.handlers import jobs, pods, startup

__all__ = ["jobs", "pods", "startup"]
