# Shared helpers for the bootstrap scripts: timed, logged steps.
RELAYTRAIN_CACHE=${RELAYTRAIN_CACHE:-$HOME/.cache/relaytrain}
export RELAYTRAIN_CACHE
mkdir -p "$RELAYTRAIN_CACHE/logs"

# run_step NAME CMD...: runs CMD with its output in a log; prints the time it took, or
# the step's name and log path when it fails (and stops the script).
run_step() {
  local name=$1; shift
  local log="$RELAYTRAIN_CACHE/logs/$(echo "$name" | tr -c 'A-Za-z0-9.-' '_').log"
  local start=$SECONDS
  printf '[bootstrap] %-40s ...\n' "$name"
  if "$@" >"$log" 2>&1; then
    printf '[bootstrap] %-40s done in %ds\n' "$name" $((SECONDS - start))
  else
    printf '[bootstrap] %-40s FAILED after %ds; log: %s\n' "$name" $((SECONDS - start)) "$log" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
}

step_skip() { printf '[bootstrap] %-40s cached (%s)\n' "$1" "$2"; }
