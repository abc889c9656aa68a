#!/usr/bin/env bash
# `make bench`: every benchmark in bench/, each printing its ratios against a baseline run
# side by side. BENCH_ARGS (e.g. --quick) goes to the scripts that take it. The operator
# benchmark gets a cluster of its own, stopped afterwards.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
cd "$repo"
for b in bench/bench_*.py; do
  [[ $b == bench/bench_operator.py ]] && continue
  echo "== $b"
  if grep -q -- '"--quick"' "$b"; then "$py" "$b" ${BENCH_ARGS:-}; else "$py" "$b"; fi
done
echo "== bench/bench_operator.py"
export RELAYTRAIN_CLUSTER=relaytrain-bench
trap 'bash "$here/cluster.sh" down' EXIT
kubeconfig=$(bash "$here/cluster.sh" up | tail -n 1)
"$py" bench/bench_operator.py --kubeconfig "$kubeconfig"
