"""Pure builders of the objects a FineTuneJob owns: plain dicts in, plain dicts out.

Nothing here imports the Kubernetes client or talks to the API server (import-linter
enforces it); `relaytrain_operator.loop.apply` creates what these functions return.
"""
