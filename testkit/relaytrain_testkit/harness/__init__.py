"""What the k8s and e2e tests (and `make demo`, and the operator benchmark) run against, in
one place.

- `cluster`: the session's local Kubernetes cluster (pytest plugin: `kube_cluster`).
- `minio_fixture`: the session's MinIO server and a fake minio client (pytest plugin:
  `minio_server`, `fake_minio`).
- `minio_server`: starts and stops a real MinIO server on loopback.
- `kwok_nodes`: simulated GPU nodes from a pool layout file (also `python -m
  relaytrain_testkit.harness.kwok_nodes POOLS.yaml --kubeconfig ...`, as hack/cluster.sh
  runs it).
- `kwok_runner`: plays the kubelet for kwok pods, running their containers as local processes
  (or, for our images, as real containers: `containers`, podman and runc).
- `registry`: a container registry on loopback (pytest plugin: `image_registry`) that images
  are pushed to and pulled from by digest.
- `real_kubelet`: a real node (pytest plugin: `real_node`): containerd and the pinned kubelet
  registered with the session's cluster as Node `real-0`, pulling from the session's registry;
  needs root, and leaves the host as it found it.
- `kubelet_volumes`: what a kubelet mounts (the ServiceAccount token from the TokenRequest API,
  the CA, the namespace; Secret volumes, written and updated as its atomic writer does),
  shown at the pod's mount path in a mount namespace of its own.
- `probes`: a kubelet's startup, liveness and readiness probes.
- `chart_install`: `helm install` of charts/relaytrain, its operator pod run by the runner as
  the chart's ServiceAccount (and a post-renderer that drops one grant).
- `operator_process`: `python -m relaytrain_operator` as a child process, and its metrics.
- `chart_rbac`: the Helm chart's ServiceAccount and RBAC applied, and a kubeconfig as it.
- `rbac_audit`: the API calls a ServiceAccount made, read from the API server's audit log,
  against what the chart grants.
- `argocd_health`: the chart's Argo CD health script, run with a real Lua runtime.
- `ports`: a free loopback port.
- `waiting`: waiting on observable state (a probe, a thread's stack) instead of sleeping.
- `operator_cases`: the FineTuneJob CRD installed, a namespace of a test's own, a job.
- `operator_env`: the operator end to end (the chart installed, stage pods run, a tiny
  model in MinIO), as the e2e tests set it up.

Import as `from relaytrain_testkit.harness import ...` (testkit/ is on pytest's path; the
harness also imports hack/, so the repository root must be on the path too).
"""
