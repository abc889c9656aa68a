#!/usr/bin/env bash
# Prints one checksum of everything that decides what the bootstrap builds or installs: the
# pins, the committed Go build modules, the image build script, the Python lock (it records pyproject.toml's
# dependencies, so a change there shows here) and the scripts that use them. CI (.ci/run)
# starts from an empty cache whenever it changes.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(hack/versions.env hack/gocomponents.sh hack/build-go-binaries.sh hack/bootstrap.sh hack/lib.sh hack/images.sh
       hack/uv-requirements.txt uv.lock worker_image/relaytrain_worker/prepare_model.py)
mapfile -t gomod < <(find hack/gomod -type f | LC_ALL=C sort)
for f in "${files[@]}" "${gomod[@]}"; do
  printf '%s\n' "$f"
  cat "$f"
done | sha256sum | cut -c1-16
