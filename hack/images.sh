#!/usr/bin/env bash
# `make images`: the operator and worker images, built from operator/Dockerfile and
# worker_image/Dockerfile with buildah (no Docker daemon) into a container storage of the
# project's own, $RELAYTRAIN_CACHE/containers, which goes with the rest of the cache.
#
#   hack/images.sh build           the tools, the base and both images (`make images`)
#   hack/images.sh tools           Debian's container tools at their pins (CONTAINER_TOOLS)
#   hack/images.sh ref NAME        the local reference of image NAME (operator, worker)
#   hack/images.sh fresh NAME      fails unless that image was built from this tree
#   hack/images.sh push REGISTRY [NAME...]  copies them to a registry; prints refs by digest
#   hack/images.sh podman ARGS...  podman on that storage, with runc and this machine's limits
#
# The base (IMAGE_BASE): `public` is the Dockerfiles' default, python:3.11-slim-bookworm
# pinned by digest, as the release builds; `debian` is one made here from Debian's packages
# with mmdebstrap (IMAGE_BASE_SUITE, IMAGE_BASE_PACKAGES in versions.env) and kept by the
# checksum of that recipe; `auto` (the default) takes the public one when its registry
# answers and the Debian one otherwise (this machine reaches no container registry).
# Both images are cached layer by layer (buildah --layers): the locked dependencies are one
# layer that only a change to the lock or uv's pin rebuilds; a change to the code rebuilds
# the small layers above it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
source "$here/versions.env"
source "$here/lib.sh"
store=$RELAYTRAIN_CACHE/containers
PUBLIC_BASE=$(sed -n 's/^ARG BASE=//p' "$repo/worker_image/Dockerfile")
HOST_CA=/etc/ssl/certs/ca-certificates.crt

# podman and buildah read where to keep images, and how to run containers, from these.
configure() {
  mkdir -p "$store"
  export CONTAINERS_STORAGE_CONF=$store/storage.conf CONTAINERS_CONF=$store/containers.conf
  [[ -f $CONTAINERS_STORAGE_CONF ]] || cat >"$CONTAINERS_STORAGE_CONF" <<CONF
[storage]
driver = "overlay"
graphroot = "$store/storage"
runroot = "$store/run"
CONF
  # runc: crun refuses a hybrid cgroup mount.
  local tmp
  tmp=$(mktemp "$store/conf.XXXXXX")
  cat >"$tmp" <<CONF
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
  if [[ ${1:-} == run ]]; then
    # A container may not ask for more open files or processes than runc may give (podman's
    # defaults do): the machine's own limit of open files, and of processes at most 32768,
    # where podman caps its own. (Builds keep buildah's.)
    local nproc
    nproc=$(ulimit -Hu)
    [[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
    cat >>"$tmp" <<CONF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=$nproc:$nproc"]
CONF
    CONTAINERS_CONF=$store/containers-run.conf
  fi
  mv "$tmp" "$CONTAINERS_CONF"  # whole, for a podman started beside this one
}

tools() {
  local spec pkg want have status missing=()
  for spec in ${CONTAINER_TOOLS//,/ }; do
    pkg=${spec%%=*} want=${spec#*=}
    # Installed means dpkg's "installed": a package removed but not purged ("config-files")
    # still has a version, and no binaries.
    # `|| true` twice: a package dpkg never saw prints nothing, and read at end of input fails
    # (under set -e that ended the script silently on a fresh machine).
    read -r status have < <(dpkg-query -W -f '${db:Status-Status} ${Version}\n' "$pkg" 2>/dev/null || true) || true
    if [[ $status != installed ]]; then
      missing+=("$spec")
    elif [[ $have != "$want" ]]; then
      echo "[images] $pkg $have is installed; the pin is $want (CONTAINER_TOOLS in hack/versions.env):" \
        "install the pin, or change it after checking the new version" >&2
      exit 1
    fi
  done
  if ((${#missing[@]})); then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
      echo "[images] needs Debian's ${missing[*]}: as root, apt-get install ${missing[*]}" >&2
      exit 1
    fi
    run_step "container tools (apt)" apt_install "${missing[@]}"
  else
    step_skip "container tools" "buildah, podman, runc, mmdebstrap, skopeo, containerd at their pins"
  fi
}

apt_install() {
  apt-get install -y --no-install-recommends "$@" || { apt-get update && apt-get install -y --no-install-recommends "$@"; }
}

# base: prints the base image's reference, building the Debian one if it is missing.
base() {
  local choice=${IMAGE_BASE:-auto}
  if [[ $choice == auto ]]; then
    if timeout 20 skopeo inspect --raw "docker://$PUBLIC_BASE" >/dev/null 2>&1; then choice=public; else choice=debian; fi
  fi
  case $choice in
    public) echo "$PUBLIC_BASE"; return ;;
    debian) ;;
    *) echo "$choice"; return ;;  # any image reference
  esac
  local key ref
  key=$(printf '%s\n' "$IMAGE_BASE_SUITE" "$IMAGE_BASE_PACKAGES" "$(declare -f debian_base)" | sha256sum | cut -c1-12)
  ref=localhost/relaytrain/base:$IMAGE_BASE_SUITE-$key
  if podman image exists "$ref"; then
    step_skip "base image (Debian $IMAGE_BASE_SUITE)" "$ref" >&2
  else
    run_step "base image (Debian $IMAGE_BASE_SUITE, mmdebstrap)" debian_base "$ref" >&2
  fi
  echo "$ref"
}

debian_base() {
  local tmp
  tmp=$(mktemp -d)
  # minbase and the Python the Dockerfiles need; no documentation but the licences.
  mmdebstrap --variant=minbase --include="$IMAGE_BASE_PACKAGES" \
    --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    "$IMAGE_BASE_SUITE" "$tmp/base.tar" \
    "deb http://deb.debian.org/debian $IMAGE_BASE_SUITE main" \
    "deb http://deb.debian.org/debian $IMAGE_BASE_SUITE-updates main" \
    "deb http://deb.debian.org/debian-security $IMAGE_BASE_SUITE-security main"
  podman import --change 'CMD ["python"]' "$tmp/base.tar" "$1"
  rm -rf "$tmp"
}

ref() { echo "localhost/relaytrain/$1:$(version)"; }
# source_digest: a checksum of what the images install from this tree (labelled on each
# image), so that a test can tell an image built from other code (`ref NAME --fresh`).
source_digest() {
  (cd "$repo" && find hack/uv-requirements.txt pyproject.toml uv.lock README.md operator worker_image \
     -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) \
    | sha256sum | cut -c1-16
}
# fresh NAME: fails, saying what to run, unless image NAME exists and was built from this tree.
fresh() {
  configure run
  local have
  have=$(podman image inspect --format '{{index .Labels "io.relaytrain.source-digest"}}' "$(ref "$1")" 2>/dev/null) \
    || { echo "image $(ref "$1") is not built: run \`make images\`" >&2; return 1; }
  [[ $have == "$(source_digest)" ]] \
    || { echo "image $(ref "$1") was built from other code than this tree's: run \`make images\`" >&2; return 1; }
}
# built NAME BASE: whether image NAME exists, built from this tree's sources on BASE (as its
# labels say): a build would then change nothing but the commit its revision label names
# (an ancestor with the same sources), and is skipped; buildah's layer cache takes seconds
# to say so.
built() {
  local have
  have=$(podman image inspect --format \
    '{{index .Labels "io.relaytrain.source-digest"}} {{index .Labels "io.relaytrain.base"}}' \
    "$(ref "$1")" 2>/dev/null) || return 1
  [[ $have == "$(source_digest) $2" ]]
}
version() { sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1; }

build_image() {
  local name=$1 dockerfile=$2 base=$3 revision ca=()
  revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
  if [[ -f $HOST_CA ]]; then  # the registries are reached through the machine's CA trust
    ca=(-v "$HOST_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt
        --build-arg SSL_CERT_FILE=/run/host-ca.crt --build-arg UV_SYSTEM_CERTS=1)
  fi
  buildah bud --isolation chroot --layers --force-rm -f "$repo/$dockerfile" --build-arg "BASE=$base" \
    --build-arg "VERSION=$(version)" --build-arg "REVISION=$revision" "${ca[@]}" \
    --label "io.relaytrain.source-digest=$(source_digest)" --label "io.relaytrain.base=$base" \
    -t "$(ref "$name")" "$repo"
}

# room: fails, saying how much is missing, unless the storage's file system has the space a
# build needs: about 16 GiB from an empty storage (the worker image is 6.3 GB and its build
# holds a working copy of its layers), 2 GiB when the images exist and only layers change.
# IMAGES_MIN_FREE_GB overrides the figure.
room() {
  local need free
  if podman image exists "$(ref worker)"; then need=${IMAGES_MIN_FREE_GB:-2}; else need=${IMAGES_MIN_FREE_GB:-16}; fi
  free=$(df -B1G --output=avail "$store" | tail -1 | tr -d ' ')
  if (( free < need )); then
    echo "[images] $store has ${free} GiB free; building the images needs about ${need} GiB:" \
         "free some space or set RELAYTRAIN_CACHE to a larger disk (IMAGES_MIN_FREE_GB overrides)" >&2
    return 1
  fi
}

build() {
  tools
  configure
  room
  local base start
  base=$(base)
  for pair in operator:operator/Dockerfile worker:worker_image/Dockerfile; do
    if built "${pair%%:*}" "$base"; then
      step_skip "image $(ref "${pair%%:*}")" "built from this tree's sources on $base"
    else
      run_step "image $(ref "${pair%%:*}")" build_image "${pair%%:*}" "${pair#*:}" "$base"
    fi
  done
  # The working containers a build stopped half-way left (a build that fails leaves its
  # own: --force-rm), then the layers of earlier builds that nothing uses now.
  buildah rm --all >/dev/null
  podman image prune -f >/dev/null
  for name in operator worker; do
    podman image inspect --format "[images] $(ref "$name") {{.Id}} {{.Size}} bytes, user {{.Config.User}}" "$(ref "$name")"
  done
}

# push REGISTRY [NAME...]: copies the images (both by default) to REGISTRY (host[:port][/path])
# as relaytrain/NAME:<version>, and prints each one's reference by digest. TLS is verified
# unless PUSH_TLS_VERIFY=false (a registry on this machine's loopback serves plain HTTP).
push() {
  local registry=${1:?usage: push REGISTRY [NAME...]} name dest digest tmp names
  shift
  names=("$@")
  ((${#names[@]})) || names=(operator worker)
  configure run
  tmp=$(mktemp)
  for name in "${names[@]}"; do
    dest="$registry/relaytrain/$name:$(version)"
    skopeo copy --quiet --dest-tls-verify="${PUSH_TLS_VERIFY:-true}" --digestfile "$tmp" \
      "containers-storage:$(ref "$name")" "docker://$dest" >&2
    digest=$(cat "$tmp")
    echo "$registry/relaytrain/$name@$digest"
  done
  rm -f "$tmp"
}

case ${1:-build} in
  build) build ;;
  tools) tools ;;
  ref) ref "$2" ;;
  fresh) fresh "$2" ;;
  push) shift; push "$@" ;;
  podman) shift; configure run; exec podman "$@" ;;
  *) echo "usage: $0 [build|tools|ref NAME|fresh NAME|push REGISTRY [NAME...]|podman ARGS...]" >&2; exit 2 ;;
esac
