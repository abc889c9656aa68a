#!/usr/bin/env bash
# Builds the cluster's programs from the committed Go build modules (hack/gomod/<component>/
# go.mod and go.sum, generated from hack/versions.env by hack/update-go-modules.sh) into
# ${RELAYTRAIN_CACHE:-$HOME/.cache/relaytrain}/bin/<name>-<version>/.
#
# The build never resolves a version: -mod=readonly makes Go use exactly the versions and
# checksums those files record and fail on anything else. After each build every binary must
# report its pin (`kube-apiserver --version`, `etcd --version`, ...); one that does not is
# refused with a message, and so is a cached binary that no longer does. A cached folder is
# rebuilt when its build module changes (the folder records the module's checksum).
#
#   hack/build-go-binaries.sh [all|COMPONENT...]   build what is missing, verify everything
#   hack/build-go-binaries.sh verify [COMPONENT...] only verify the cached binaries
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
source "$here/lib.sh"
source "$here/gocomponents.sh"

export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -mod=readonly" GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
bin_root="$RELAYTRAIN_CACHE/bin"
mkdir -p "$bin_root"

folder() { echo "$bin_root/$1-$(component_version "$1")"; }

# inputs NAME: the checksum of what a build of NAME depends on: its committed module (with
# a main package of ours), its link flags, its build tags and the pin.
inputs() {
  cat "$here/gomod/$1/go.mod" "$here/gomod/$1/go.sum"
  find "$here/gomod/$1" -name '*.go' -type f | LC_ALL=C sort | xargs -r cat
  echo "$(component_version "$1") $(component_ldflags "$1") tags: $(component_tags "$1")"
  local files
  files=$(component_files "$1")
  if [[ -n $files ]]; then echo "files: $files"; fi
}
inputs_sum() { inputs "$1" | sha256sum | cut -c1-16; }

# check_module NAME: the committed module must require the pin of versions.env.
check_module() {
  local name=$1 module version dir
  module=$(component_module "$name"); version=$(component_version "$name"); dir="$here/gomod/$name"
  if [[ ! -f $dir/go.mod || ! -f $dir/go.sum ]]; then
    echo "hack/gomod/$name/go.mod or go.sum is missing: run \`make go-modules\`" >&2; return 1
  fi
  if ! grep -qE "^\s*(require\s+)?$module $version(\s|$)" "$dir/go.mod"; then
    echo "hack/gomod/$name/go.mod does not require $module $version (the pin in hack/versions.env):" \
         "run \`make go-modules\` and commit the result" >&2
    return 1
  fi
}

build() {
  local name=$1 out dir pkg
  out=$(folder "$name"); dir="$here/gomod/$name"
  rm -rf "$out.tmp"
  local ld
  ld="-s -w $(component_ldflags "$name")"
  for pkg in $(component_packages "$name"); do
    (cd "$dir" && go build -trimpath -tags "$(component_tags "$name")" -ldflags "$ld" \
      -o "$out.tmp/$(component_binary "$pkg")" "$pkg") || return 1
  done
  local files src path
  files=$(component_files "$name")
  if [[ -n $files ]]; then
    # Downloaded (checked against go.sum) if no build did; then its folder in the module cache.
    (cd "$dir" && go mod download "$(component_module "$name")") || return 1
    src=$(cd "$dir" && go list -m -f '{{.Dir}}' "$(component_module "$name")") || return 1
    for path in $files; do
      mkdir -p "$out.tmp/files/$(dirname "$path")"
      cp -R "$src/$path" "$out.tmp/files/$path" || return 1
    done
    chmod -R u+w "$out.tmp/files"
  fi
  inputs_sum "$name" >"$out.tmp/.inputs"
}

# verify NAME [FOLDER]: every binary of NAME reports its pin, or the script stops saying which
# binary printed what and what was expected.
verify() {
  local name=$1 dir=${2:-$(folder "$1")} line bin args want got
  while IFS='|' read -r bin args want; do
    # shellcheck disable=SC2086
    got=$("$dir/$bin" $args 2>&1 | head -n 5) || true
    if [[ $got != *"$want"* ]]; then
      printf '[bootstrap] %s does not report its pin: `%s %s` printed\n    %s\n  expected it to contain "%s" (hack/versions.env). Remove %s and run `make deps` to rebuild it.\n' \
        "$dir/$bin" "$bin" "$args" "${got//$'\n'/$'\n    '}" "$want" "$dir" >&2
      return 1
    fi
  done < <(component_version_checks "$name")
}

mode=build
if [[ ${1:-} == verify ]]; then mode=verify; shift; fi
names=("$@")
if [[ ${#names[@]} -eq 0 || ${names[0]} == all ]]; then names=("${COMPONENTS[@]}"); fi

if [[ $mode == verify ]]; then
  for name in "${names[@]}"; do verify "$name"; done
  exit 0
fi

# One build at a time per cache (two test runs may bootstrap at once); the loser of the
# race finds the binaries cached when it gets the lock.
exec 9>"$bin_root/.lock"
flock 9
for name in "${names[@]}"; do
  check_module "$name"
  out=$(folder "$name")
  if [[ -d $out && $(cat "$out/.inputs" 2>/dev/null) == "$(inputs_sum "$name")" ]]; then
    verify "$name"
    step_skip "build $name $(component_version "$name")" "cached in $out"
    continue
  fi
  [[ -d $out ]] && echo "[bootstrap] $out was built from other inputs: rebuilding it" >&2
  run_step "build $name $(component_version "$name")" build "$name"
  verify "$name" "$out.tmp"
  rm -rf "$out"
  mv -T "$out.tmp" "$out"
done
