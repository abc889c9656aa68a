#!/usr/bin/env bash
# `make demo`: see hack/demo.py (a module: it imports the test harness's kwok runner,
# MinIO server and operator launcher from testkit/relaytrain_testkit/harness/).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
exec "${PYTHON:-$repo/.venv/bin/python}" -m hack.demo "$@"
