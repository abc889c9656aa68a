"""The reconcile loop: kopf handlers → runner → observe → decide → actions → executor (apply).

Layers inside (checked by import-linter): handlers over runner over observe over apply and
decide over actions; options and metrics at the bottom.
"""
