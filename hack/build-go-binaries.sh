#!/usr/bin/env bash
# Builds the cluster's programs from their published Go modules, pinned in
# hack/versions.env, into ${RELAYTRAIN_CACHE:-$HOME/.cache/relaytrain}/bin/<name>-<version>/.
# A binary already in the cache is not built again. Each step prints its time; a failed
# step stops the script with the step's name and the path of its log.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
source "$here/lib.sh"

export CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
bin_root="$RELAYTRAIN_CACHE/bin"
work_root="$RELAYTRAIN_CACHE/gobuild"
mkdir -p "$bin_root" "$work_root"

# wrapper_module DIR MODULE@VERSION [REPLACES]: a throwaway module that requires MODULE.
wrapper_module() {
  local dir=$1 req=$2 replaces=${3:-}
  mkdir -p "$dir" || return 1
  printf 'module relaytrain.local/build\n\ngo 1.26.0\n\n%s\n' "$replaces" >"$dir/go.mod"
  (cd "$dir" && go mod edit -require="$req")
}

build_kubernetes() {
  local v=$KUBERNETES_VERSION out="$bin_root/kubernetes-$KUBERNETES_VERSION" dir="$work_root/kubernetes-$KUBERNETES_VERSION"
  local minor=${v#v1.}; minor=${minor%%.*}
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
  # local folders; those replaces do not apply to a dependent module, so point each
  # one at its published v0.X.Y twin.
  local modfile replaces
  modfile=$(go mod download -json "k8s.io/kubernetes@$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  replaces=$(grep -E '^\s*k8s\.io/[A-Za-z0-9._/-]+ v0\.0\.0\s*$' "$modfile" | awk -v m="$minor" -v p="${v##*.}" '{printf "replace %s => %s v0.%s.%s\n", $1, $1, m, p}')
  wrapper_module "$dir" "k8s.io/kubernetes@$v" "$replaces"
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  local cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
  (cd "$dir" && go get "${cmds[@]/#/k8s.io/kubernetes/cmd/}") || return 1
  for cmd in "${cmds[@]}"; do
    (cd "$dir" && go build -trimpath -ldflags "$ld" -o "$out.tmp/$cmd" "k8s.io/kubernetes/cmd/$cmd") || return 1
  done
  mv -T "$out.tmp" "$out"
}

build_etcd() {
  local out="$bin_root/etcd-$ETCD_VERSION" dir="$work_root/etcd-$ETCD_VERSION"
  wrapper_module "$dir" "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  (cd "$dir" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" \
     && go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3) || return 1
  mv -T "$out.tmp" "$out"
}

build_kwok() {
  local out="$bin_root/kwok-$KWOK_VERSION" dir="$work_root/kwok-$KWOK_VERSION"
  wrapper_module "$dir" "sigs.k8s.io/kwok@$KWOK_VERSION"
  local ld="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$KUBERNETES_VERSION"
  (cd "$dir" && go get "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION" \
     && go build -trimpath -ldflags "$ld" -o "$out.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok \
     && go build -trimpath -ldflags "$ld" -o "$out.tmp/kwokctl" sigs.k8s.io/kwok/cmd/kwokctl) || return 1
  mv -T "$out.tmp" "$out"
}

build_minio() {
  local out="$bin_root/minio-$MINIO_VERSION" dir="$work_root/minio-$MINIO_VERSION"
  wrapper_module "$dir" "github.com/minio/minio@$MINIO_VERSION"
  (cd "$dir" && go get "github.com/minio/minio@$MINIO_VERSION" \
     && go build -trimpath -ldflags "-s -w" -o "$out.tmp/minio" github.com/minio/minio) || return 1
  mv -T "$out.tmp" "$out"
}

build_helm() {
  local out="$bin_root/helm-$HELM_VERSION" dir="$work_root/helm-$HELM_VERSION"
  wrapper_module "$dir" "helm.sh/helm/v3@$HELM_VERSION"
  (cd "$dir" && go get "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" \
     && go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" -o "$out.tmp/helm" helm.sh/helm/v3/cmd/helm) || return 1
  mv -T "$out.tmp" "$out"
}

only=${1:-all}
# One build at a time per cache (two test runs may bootstrap at once); the loser of the
# race finds the binaries cached when it gets the lock.
exec 9>"$bin_root/.lock"
flock 9
for name in etcd kwok kubernetes minio helm; do
  [[ $only == all || $only == "$name" ]] || continue
  ver_var=$(echo "${name}_VERSION" | tr a-z A-Z)
  [[ -d $bin_root/$name-${!ver_var} ]] && { step_skip "build $name ${!ver_var}" "cached in $bin_root/$name-${!ver_var}"; continue; }
  rm -rf "$bin_root/$name-${!ver_var}.tmp"
  run_step "build $name ${!ver_var}" "build_$name"
done
