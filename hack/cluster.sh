#!/usr/bin/env bash
# The local Kubernetes cluster: real kube-apiserver, etcd, kube-controller-manager and
# kube-scheduler built by build-go-binaries.sh, started by kwokctl's binary runtime, with
# simulated GPU nodes from a pool layout file. Everything listens on 127.0.0.1 on free
# ports, so two clusters (two test runs) on one machine do not collide.
#
#   hack/cluster.sh up          start (idempotent) and print the kubeconfig path
#   hack/cluster.sh down        stop everything it started and remove its state
#   hack/cluster.sh kubeconfig  print the kubeconfig path alone
#
# Environment: RELAYTRAIN_CLUSTER (name, default relaytrain), RELAYTRAIN_POOLS (pool file,
# default hack/pools.yaml), KWOK_WORKDIR (state, default $RELAYTRAIN_CACHE/kwok).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions.env"
source "$here/lib.sh"

name=${RELAYTRAIN_CLUSTER:-relaytrain}
pools=${RELAYTRAIN_POOLS:-$here/pools.yaml}
export KWOK_WORKDIR=${KWOK_WORKDIR:-$RELAYTRAIN_CACHE/kwok}
python=${PYTHON:-$here/../.venv/bin/python}
bin=$RELAYTRAIN_CACHE/bin
k8s=$bin/kubernetes-$KUBERNETES_VERSION
kwok=$bin/kwok-$KWOK_VERSION
cluster_dir=$KWOK_WORKDIR/clusters/$name
kubeconfig=$cluster_dir/kubeconfig.yaml
export PATH=$k8s:$PATH  # kwokctl runs kubectl for some commands

free_ports() {  # free_ports N: N distinct free TCP ports on 127.0.0.1
  "$python" - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

healthy() {
  [[ -f $kubeconfig ]] && "$k8s/kubectl" --kubeconfig "$kubeconfig" --request-timeout=5s get --raw /readyz >/dev/null 2>&1
}

# wait_serving SCHEDULER_PORT CONTROLLER_MANAGER_PORT: kwokctl's --wait checks only that the
# processes run and the API server answers /healthz. A pod needs more: the scheduler to bind
# it, and the controller manager's ServiceAccount controller to have made the namespace's
# `default` ServiceAccount (the API server refuses pods until then). On a cold machine those
# two can lag the API server by tens of seconds, so wait until each says it is ready.
wait_serving() {
  local sched=$1 kcm=$2 deadline=$((SECONDS + 180)) missing
  while :; do
    missing=()
    curl -ksf --max-time 2 "https://127.0.0.1:$sched/readyz" >/dev/null || missing+=("kube-scheduler /readyz")
    curl -ksf --max-time 2 "https://127.0.0.1:$kcm/healthz" >/dev/null || missing+=("kube-controller-manager /healthz")
    "$k8s/kubectl" --kubeconfig "$kubeconfig" --request-timeout=5s -n default get serviceaccount default \
      >/dev/null 2>&1 || missing+=("the default ServiceAccount")
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if ((SECONDS > deadline)); then
      echo "Cluster $name: still waiting for ${missing[*]} after 180s; logs: $cluster_dir/logs/" >&2
      return 1
    fi
    sleep 0.5
  done
}

up() {
  if healthy; then
    echo "Cluster $name is already running." >&2
  else
    [[ -d $cluster_dir ]] && "$kwok/kwokctl" --name "$name" delete cluster >/dev/null 2>&1 || true
    read -r etcd peer api kcm sched kwokp <<<"$(free_ports 6)"
    local start=$SECONDS
    # Every component on loopback (bindAddress). node-monitor-grace-period is short so a
    # node that stops heartbeating is marked NotReady within a test's patience; kwok renews
    # node leases often enough (every ~5 s) that healthy nodes never flap. kwok manages
    # nodes annotated kwok.x-k8s.io/node=fake, and leaves the status of a node annotated
    # kwok.x-k8s.io/status=custom alone, so a test can post NotReady as a failing kubelet would.
    # The API server also enforces what real clusters (OpenShift among them) enforce: a
    # child whose owner reference blocks owner deletion needs `update` on the owner's
    # finalizers. It writes an audit log of every ServiceAccount's requests (audit-policy.yaml).
    # The controller manager and the scheduler are the only ones of their kind, so they hold
    # no leader lease: with one, a stall of etcd longer than the lease's renew deadline (a
    # busy disk: 2026-12-04, "etcdserver: request timed out" while images were pushed beside
    # `make demo`) made each exit as a lost leader, and the cluster made no more ServiceAccounts,
    # bindings or node-lifecycle changes for the rest of the session. etcd does not fsync: the
    # cluster's state is thrown away when it stops, and an fsync on a busy disk is what stalls.
    mkdir -p "$KWOK_WORKDIR"
    local config="$KWOK_WORKDIR/$name.kwokctl.yaml"
    cat >"$config" <<YAML
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  bindAddress: 127.0.0.1
  heartbeatFactor: 1
  nodeLeaseDurationSeconds: 20
  kubeControllerManagerNodeMonitorPeriodMilliseconds: 2000
  kubeControllerManagerNodeMonitorGracePeriodMilliseconds: 20000
componentsPatches:
  - name: etcd
    extraArgs:
      - {key: listen-peer-urls, value: "http://127.0.0.1:$peer", override: true}
      - {key: initial-advertise-peer-urls, value: "http://127.0.0.1:$peer", override: true}
      - {key: initial-cluster, value: "node0=http://127.0.0.1:$peer", override: true}
      - {key: unsafe-no-fsync, value: "true"}
  - name: kube-apiserver
    extraArgs:
      - {key: enable-admission-plugins, value: OwnerReferencesPermissionEnforcement}
  - name: kube-controller-manager
    extraArgs:
      - {key: leader-elect, value: "false"}
  - name: kube-scheduler
    extraArgs:
      - {key: leader-elect, value: "false"}
  - name: kwok-controller
    extraArgs:
      - {key: manage-all-nodes, value: "false", override: true}
      - {key: manage-nodes-with-annotation-selector, value: "kwok.x-k8s.io/node=fake"}
      - {key: disregard-status-with-annotation-selector, value: "kwok.x-k8s.io/status=custom"}
YAML
    "$kwok/kwokctl" --name "$name" -c "$config" create cluster --runtime binary --wait 120s \
      --kube-audit-policy "$here/audit-policy.yaml" \
      --kubeconfig "$cluster_dir.kubeconfig" \
      --etcd-binary "$bin/etcd-$ETCD_VERSION/etcd" \
      --kube-apiserver-binary "$k8s/kube-apiserver" \
      --kube-controller-manager-binary "$k8s/kube-controller-manager" \
      --kube-scheduler-binary "$k8s/kube-scheduler" \
      --kwok-controller-binary "$kwok/kwok" \
      --etcd-port "$etcd" --kube-apiserver-port "$api" \
      --kube-controller-manager-port "$kcm" --kube-scheduler-port "$sched" --controller-port "$kwokp" >&2
    wait_serving "$sched" "$kcm"
    echo "Started cluster $name in $((SECONDS - start))s." >&2
  fi
  # The node generator is a module of the test harness (testkit/): the repository root and
  # testkit/ on the path, the caller's folder off it (-P), so a relative $pools still means
  # what it meant.
  PYTHONPATH="$(dirname "$here"):$(dirname "$here")/testkit${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -P -m relaytrain_testkit.harness.kwok_nodes "$pools" --kubeconfig "$kubeconfig" >&2
  echo "$kubeconfig"
}

down() {
  if [[ -d $cluster_dir ]]; then
    "$kwok/kwokctl" --name "$name" delete cluster >&2 || true
    rm -rf "$cluster_dir" "$cluster_dir.kubeconfig"
    echo "Stopped cluster $name." >&2
  else
    echo "No cluster $name to stop." >&2
  fi
}

case ${1:-} in
  up) up ;;
  down) down ;;
  kubeconfig) echo "$kubeconfig" ;;
  *) echo "usage: $0 up|down|kubeconfig" >&2; exit 2 ;;
esac
