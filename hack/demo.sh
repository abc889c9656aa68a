#!/usr/bin/env bash
# `make demo`: see hack/demo.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "${PYTHON:-$here/../.venv/bin/python}" "$here/demo.py" "$@"
