#!/usr/bin/env bash
# `make test`: every test tier, in four pytest sessions, two at a time (arguments: pytest's,
# for each).
#
# First the tiers that need no cluster (unit, contract: torch's threads, the CPU) beside the
# k8s tier (the operator against a real control plane: it mostly waits on the API server,
# about 30 % of two cores). Side by side they took 277 s where one after the other took 413 s
# (2026-11-29, 2-core machine).
#
# Then the e2e tier, in two sessions side by side: the tests on a control plane or the
# machine's container runtime (marked `cluster` by tests/conftest.py: the session's cluster,
# `make demo`'s, the real kubelet's, the images') and the ones that use neither (local runs
# of real stage processes, MinIO, shaped links). Alone, the e2e tier left 45 % of two cores
# idle (the median of `vmstat 5` over it, 2026-12-02): its tests wait on processes starting,
# on links paced to a rate, on a control plane. Every session has its own cluster and MinIO
# where it needs them; a session's tests share theirs.
#
# The second session of each pair prints its output once the first is done (two sessions
# writing at once would interleave line by line). The exit status is the first failing
# session's (pytest's 5, no test collected, fails too).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
side_log=$(mktemp "${TMPDIR:-/tmp}/relaytrain-side-tier.XXXXXX")
trap 'rm -f "$side_log"' EXIT

# pair NAME_A MARKERS_A NAME_B MARKERS_B [pytest args]: runs B beside A, then prints B's
# output; sets a_rc and b_rc.
pair() {
  local name_a=$1 marks_a=$2 name_b=$3 marks_b=$4 side
  shift 4
  echo "[test] $name_b, beside $name_a (their output follows it)"
  "$PY" -m pytest tests -m "$marks_b" "$@" >"$side_log" 2>&1 &
  side=$!
  "$PY" -m pytest tests -m "$marks_a" "$@"
  a_rc=$?
  wait "$side"
  b_rc=$?
  echo "[test] $name_b (exit $b_rc):"
  cat "$side_log"
}

pair "the k8s tier" "k8s and not unit and not contract" \
  "the unit and contract tiers" "unit or contract" "$@"
k8s=$a_rc unit=$b_rc
echo "[test] the k8s tier exited $k8s; now the e2e tier and any test of no tier"
rest="not unit and not contract and not k8s"
pair "the e2e tests on a cluster or the container runtime" "$rest and cluster" \
  "the e2e tests on neither" "$rest and not cluster" "$@"
cluster=$a_rc local=$b_rc
echo "[test] exits: unit and contract $unit, k8s $k8s, e2e on a cluster $cluster, e2e local $local"
for code in "$unit" "$k8s" "$cluster" "$local"; do
  if [[ $code -ne 0 ]]; then
    exit "$code"
  fi
done
