# The Go-built components: which module each comes from, its pin in versions.env, the
# packages built into its cache folder, and the link flags that make each binary report
# its pin. Sourced by build-go-binaries.sh and update-go-modules.sh (after versions.env).
COMPONENTS=(etcd kwok kubernetes minio helm kstatus kueue promtool promoperator actionlint registry)

component_module() {
  case $1 in
    etcd) echo go.etcd.io/etcd/server/v3 ;;
    kwok) echo sigs.k8s.io/kwok ;;
    kubernetes) echo k8s.io/kubernetes ;;
    minio) echo github.com/minio/minio ;;
    helm) echo helm.sh/helm/v3 ;;
    kstatus) echo sigs.k8s.io/cli-utils ;;
    kueue) echo sigs.k8s.io/kueue ;;
    promtool) echo github.com/prometheus/prometheus ;;
    promoperator) echo github.com/prometheus-operator/prometheus-operator ;;
    actionlint) echo github.com/rhysd/actionlint ;;
    registry) echo github.com/distribution/distribution/v3 ;;
  esac
}

# component_own_main NAME: true when the build module is a main package of ours (its .go
# files committed beside go.mod) that requires the component's module, not a tool of it.
component_own_main() { [[ $1 == kstatus ]]; }

# component_files_only NAME: true when nothing is built, only files copied out of the module
# (the prometheus-operator's CRDs, which the tests apply the chart's monitoring objects to).
component_files_only() { [[ -z $(component_packages "$1") ]]; }

component_version() {
  local var
  var=$(echo "$1_VERSION" | tr a-z A-Z)
  echo "${!var}"
}

# The packages built, one binary each, named after the last path element.
component_packages() {
  case $1 in
    etcd) echo go.etcd.io/etcd/server/v3 ;;
    kwok) echo sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl ;;
    # kubelet: the real node of tests/e2e/test_real_kubelet.py (harness/real_kubelet.py).
    kubernetes) printf 'k8s.io/kubernetes/cmd/%s ' kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet ;;
    minio) echo github.com/minio/minio ;;
    helm) echo helm.sh/helm/v3/cmd/helm ;;
    kstatus) echo . ;;
    kueue) echo sigs.k8s.io/kueue/cmd/kueue ;;
    promtool) echo github.com/prometheus/prometheus/cmd/promtool ;;
    actionlint) echo github.com/rhysd/actionlint/cmd/actionlint ;;
    registry) echo github.com/distribution/distribution/v3/cmd/registry ;;
  esac
}

# component_files NAME: paths inside the component's module copied beside its binaries into
# files/ (kueue's CRDs, their conversion-webhook patches and its webhook configurations,
# which the tests install from the same pinned, checksummed module the controller is built
# from).
component_files() {
  case $1 in
    kueue) echo config/components/crd/kustomization.yaml config/components/crd/bases config/components/crd/patches config/components/webhook/manifests.yaml ;;
    promoperator) echo example/prometheus-operator-crd ;;
  esac
}

component_binary() {  # component_binary PACKAGE: the binary's file name
  case $1 in
    go.etcd.io/etcd/server/v3) echo etcd ;;
    .) echo kstatus-check ;;
    *) echo "${1##*/}" ;;
  esac
}

# component_tags NAME: Go build tags. promtool's: without Prometheus's service discoveries
# (its plugins package honours remove_all_sd), which the rule checks and rule tests never use;
# they pull in the AWS, Azure, GCE, Kubernetes and a dozen more clients, the most of its build.
component_tags() {
  case $1 in
    promtool) echo remove_all_sd ;;
  esac
}

# component_ldflags NAME: -X flags so `--version` reports the pin (a module built with
# `go build` outside its own repository gets none of the release build's stamps).
component_ldflags() {
  local v
  v=$(component_version "$1")
  case $1 in
    kubernetes)
      local minor pkg
      minor=${v#v1.}; minor=${minor%%.*}
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        printf -- '-X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=1970-01-01T00:00:00Z ' \
          "$pkg" "$v" "$pkg" "$pkg" "$minor" "$pkg" "$pkg"
      done ;;
    kwok)
      echo "-X sigs.k8s.io/kwok/pkg/consts.Version=${v#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$KUBERNETES_VERSION" ;;
    minio)
      # A pseudo-version v0.0.0-YYYYMMDDhhmmss-COMMIT: MinIO reports RELEASE.<time> and the commit.
      local stamp=${v#v0.0.0-} commit
      commit=${stamp#*-}; stamp=${stamp%%-*}
      local t="${stamp:0:4}-${stamp:4:2}-${stamp:6:2}T${stamp:8:2}:${stamp:10:2}:${stamp:12:2}Z"
      local tag="RELEASE.${t//:/-}"
      echo "-X github.com/minio/minio/cmd.Version=$t -X github.com/minio/minio/cmd.ReleaseTag=$tag -X github.com/minio/minio/cmd.CommitID=$commit -X github.com/minio/minio/cmd.ShortCommitID=${commit:0:12}" ;;
    helm)
      echo "-X helm.sh/helm/v3/internal/version.version=$v" ;;
    kstatus)
      echo "-X main.version=$v" ;;
    kueue)
      echo "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$v -X sigs.k8s.io/kueue/pkg/version.BuildDate=1970-01-01" ;;
    registry)
      echo "-X github.com/distribution/distribution/v3/version.version=$v" ;;
    promtool)
      # The module's v0.3MM.P is Prometheus 3.MM.P.
      local mm=${v#v0.3}; mm=${mm%%.*}
      echo "-X github.com/prometheus/common/version.Version=3.$((10#$mm)).${v##*.} -X github.com/prometheus/common/version.Branch=HEAD -X github.com/prometheus/common/version.Revision=$v" ;;
  esac
}

# component_version_checks NAME: lines "BINARY|ARGS|EXPECTED" — run BINARY ARGS and expect
# EXPECTED in what it prints.
component_version_checks() {
  local v
  v=$(component_version "$1")
  case $1 in
    etcd) echo "etcd|--version|etcd Version: ${v#v}" ;;
    kwok) echo "kwok|--version|${v#v}"; echo "kwokctl|--version|${v#v}" ;;
    kubernetes)
      echo "kube-apiserver|--version|Kubernetes $v"
      echo "kube-controller-manager|--version|Kubernetes $v"
      echo "kube-scheduler|--version|Kubernetes $v"
      echo "kubelet|--version|Kubernetes $v"
      echo "kubectl|version --client|Client Version: $v"
      local minor=${v#v1.}
      echo "kubectl|version --client -o json|\"minor\": \"${minor%%.*}\"" ;;
    minio)
      local commit=${v##*-}
      echo "minio|--version|commit-id=$commit" ;;
    helm) echo "helm|version --short|$v" ;;
    kstatus) echo "kstatus-check|--version|sigs.k8s.io/cli-utils $v" ;;
    # kueue has no --version: it logs its version first, then fails on the missing kubeconfig.
    kueue) echo "kueue|--kubeconfig=/nonexistent/relaytrain-version-check|\"gitVersion\":\"$v\"" ;;
    promtool) echo "promtool|--version|revision: $v" ;;
    actionlint) echo "actionlint|-version|$v" ;;
    registry) echo "registry|--version|github.com/distribution/distribution/v3 $v" ;;
  esac
}
