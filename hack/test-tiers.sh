#!/usr/bin/env bash
# `make test`: every test tier, in three pytest sessions (arguments: pytest's, for each).
#
# The tiers that need no cluster (unit, contract: torch's threads, the CPU) run beside the
# k8s tier (the operator against a real control plane: it mostly waits on the API server,
# about 30 % of two cores), and the e2e tier runs after both, alone: its stages train for
# real and several of its tests time what they train. Side by side the first two took 277 s
# where one after the other took 413 s (2026-11-29, 2-core machine). Each session has its
# own cluster and MinIO where it needs them; the e2e tier's tests share theirs.
#
# The unit and contract session's output is printed once the k8s session is done (two
# sessions writing at once would interleave line by line). The exit status is the first
# failing session's (pytest's 5, no test collected, fails too).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
side_log=$(mktemp "${TMPDIR:-/tmp}/relaytrain-unit-tier.XXXXXX")
trap 'rm -f "$side_log"' EXIT

echo "[test] the unit and contract tiers, beside the k8s tier (their output follows it)"
"$PY" -m pytest tests -m "unit or contract" "$@" >"$side_log" 2>&1 &
side=$!
"$PY" -m pytest tests -m "k8s and not unit and not contract" "$@"
k8s=$?
wait "$side"
unit=$?
echo "[test] the unit and contract tiers (exit $unit):"
cat "$side_log"
echo "[test] the k8s tier exited $k8s; now the e2e tier and any test of no tier"
"$PY" -m pytest tests -m "not unit and not contract and not k8s" "$@"
rest=$?
echo "[test] exits: unit and contract $unit, k8s $k8s, e2e $rest"
for code in "$unit" "$k8s" "$rest"; do
  if [[ $code -ne 0 ]]; then
    exit "$code"
  fi
done
