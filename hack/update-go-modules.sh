#!/usr/bin/env bash
# Regenerates the committed Go build modules, hack/gomod/<component>/go.mod and go.sum, from
# the pins in hack/versions.env. This is the one command that changes what the bootstrap
# builds: edit a version in versions.env, run
#
#   make go-modules            (or: bash hack/update-go-modules.sh [component...])
#
# and review the diff of versions.env and hack/gomod/. The bootstrap itself never resolves
# anything: it builds with -mod=readonly against these files, so only the pinned and
# checksummed module versions can be used.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions.env"
source "$here/gocomponents.sh"

export CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOTOOLCHAIN=${GOTOOLCHAIN:-auto}

# kubernetes_replaces VERSION: k8s.io/kubernetes requires its staging modules at v0.0.0 and
# replaces them with folders of its own repository; those replaces do not apply to a module
# that depends on it, so point each one at its published v0.X.Y twin.
kubernetes_replaces() {
  local v=$1 minor modfile
  minor=${v#v1.}; minor=${minor%%.*}
  modfile=$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  grep -E '^\s*k8s\.io/[A-Za-z0-9._/-]+ v0\.0\.0\s*$' "$modfile" \
    | awk -v m="$minor" -v p="${v##*.}" '{printf "-replace=%s=%s@v0.%s.%s\n", $1, $1, m, p}'
}

update() {
  local name=$1 module version dir
  module=$(component_module "$name"); version=$(component_version "$name")
  dir="$here/gomod/$name"
  echo "[go-modules] $name: $module@$version"
  # go.mod and go.sum are regenerated; a main package of ours (*.go) stays.
  mkdir -p "$dir"; rm -f "$dir/go.mod" "$dir/go.sum"
  (
    cd "$dir"
    go mod init "relaytrain.local/build/$name" >/dev/null 2>&1
    if [[ $name == kubernetes ]]; then
      # shellcheck disable=SC2046
      go mod edit $(kubernetes_replaces "$version")
    fi
    if component_files_only "$name"; then
      # Nothing imports it: required by hand, its checksums recorded, and no tidy (which
      # would drop a requirement no package uses).
      go mod edit -require="$module@$version"
      go mod download "$module"
    else
      if component_own_main "$name"; then
        go get "$module@$version"
      else
        # One `go get` per tool: mixing packages of one module at one version in a single
        # call is fine, but each names its version so nothing newer is ever picked.
        for pkg in $(component_packages "$name"); do
          go get -tool "$pkg@$version"
        done
      fi
      go mod tidy
    fi
    # The module's `go` line follows the highest dependency; keep no toolchain line so
    # GOTOOLCHAIN=auto picks the minimum the modules need.
    go mod edit -toolchain=none
  )
}

names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("${COMPONENTS[@]}")
for name in "${names[@]}"; do update "$name"; done
