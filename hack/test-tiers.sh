#!/usr/bin/env bash
# `make test`: every test tier, in four pytest sessions, in two lanes side by side, each lane
# two sessions one after the other (arguments: pytest's, for each).
#
# Lane A: the k8s tier (the operator against a real control plane: it mostly waits on the
# API server, about 30 % of two cores), then the e2e tests on a control plane or the
# machine's container runtime (marked `cluster` by tests/conftest.py: the session's cluster,
# the real kubelet's, the images'), but for `make demo`'s.
# Lane B: the tiers that need no cluster (unit, contract: torch's threads, the CPU), then the
# e2e tests that use neither (local runs of real stage processes, MinIO, shaped links: their
# runs fork their stages from one prefork server the session shares) and `make demo`'s
# (marked `demo`: it starts a cluster of its own).
#
# Why lanes and not pairs: the unit tier outlasts the k8s tier, and the e2e tests on a
# cluster outlast the local ones; waiting for both of a pair before the next pair left a
# core idle at each end. `make demo` (2½–4 minutes) goes to the lane with the shorter e2e
# session. The whole tier side by side with itself took 277 s where one after the other took
# 413 s (2026-11-29); alone, the e2e tier left 45 % of two cores idle (2026-12-02). Every
# session has its own cluster and MinIO where it needs them; a session's tests share theirs.
#
# Lane B prints its output once lane A is done (two sessions writing at once would
# interleave line by line). The exit status is the first failing session's (pytest's 5, no
# test collected, fails too).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
side_log=$(mktemp "${TMPDIR:-/tmp}/relaytrain-side-lane.XXXXXX")
codes=$(mktemp "${TMPDIR:-/tmp}/relaytrain-lane-codes.XXXXXX")
trap 'rm -f "$side_log" "$codes"' EXIT
rest="not unit and not contract and not k8s"

# session NAME MARKERS [pytest args]: one pytest session; records "NAME EXIT" in $codes.
session() {
  local name=$1 marks=$2
  shift 2
  echo "[test] $name:"
  SECONDS=0
  "$PY" -m pytest tests -m "$marks" "$@"
  local rc=$?
  echo "[test] $name exited $rc after ${SECONDS} s"
  echo "$name $rc" >>"$codes"
}

echo "[test] lane B (the unit and contract tiers, then the e2e tests on no cluster and make demo's) runs beside lane A; its output follows lane A's"
(
  session "the unit and contract tiers" "unit or contract" "$@"
  session "the e2e tests on no cluster, and make demo's" "$rest and (not cluster or demo)" "$@"
) >"$side_log" 2>&1 &
side=$!
session "the k8s tier" "k8s and not unit and not contract" "$@"
session "the e2e tests on a cluster or the container runtime" "$rest and cluster and not demo" "$@"
wait "$side"
echo "[test] lane B:"
cat "$side_log"
echo "[test] exits: $(awk '{printf "%s%s", (NR > 1 ? ", " : ""), $0}' "$codes")"
first=$(awk '$NF != 0 {print $NF; exit}' "$codes")
exit "${first:-0}"
