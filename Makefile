# relaytrain — start here: `make demo` runs the main job, `make test` runs every test.
# Both install what they need first (`make deps`), idempotently.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
export RELAYTRAIN_CACHE ?= $(HOME)/.cache/relaytrain

.PHONY: help deps deps-python deps-binaries deps-model test test-fast test-unit test-contract test-k8s test-e2e \
        chaos lint format demo bench images push gpu-check cluster-up cluster-down kubeconfig crds chart-crds lock go-modules

help:
	@echo "make demo          run the main job (installs what it needs first)"
	@echo "make test          run every test tier (installs what it needs first)"
	@echo "make test-fast     the loop while changing code: every test without a cluster, MinIO or torch (< 1 min)"
	@echo "make cluster-up    start the local cluster; prints its kubeconfig path"
	@echo "make -s kubeconfig print that path alone (export KUBECONFIG=\$$(make -s kubeconfig))"
	@echo "make cluster-down  stop everything cluster-up started"
	@echo "make bench         run the benchmarks in bench/"
	@echo "make images        build the operator and worker images with buildah (hack/images.sh)"
	@echo "make push REGISTRY=host[:port]  copy both images there; prints each one's digest"
	@echo "make gpu-check     prepare the GPU check (wheels into .whl/) and print what a GPU host runs"
	@echo "make chaos         the chaos and churn schedules with real training, tables printed"
	@echo "make lint          ruff, mypy, import-linter and actionlint"
	@echo "make crds          regenerate the CRD (and the chart's copy) after editing the spec models"
	@echo "make lock          refresh uv.lock after editing pyproject.toml"
	@echo "make go-modules    regenerate hack/gomod/ after editing a pin in hack/versions.env"

deps:
	@bash hack/bootstrap.sh all
deps-python:
	@bash hack/bootstrap.sh python
deps-binaries:
	@bash hack/bootstrap.sh binaries
deps-model: deps-python
	@bash hack/bootstrap.sh model

# Every tier, in two lanes: k8s then e2e on a cluster, beside unit and contract then the
# other e2e tests (hack/test-tiers.sh says why). Tests
# marked gpu are reported as skipped where no CUDA exists.
test: deps images
	PY=$(PY) bash hack/test-tiers.sh $(PYTEST_ARGS)

# The loop while changing code: every test that needs no cluster, no MinIO and no torch
# (tests/conftest.py marks a test `torch` when its module imports torch, directly or through
# the project's modules; a module that needs torch is not even imported). Under a minute here
# once Python's bytecode is cached: kept by version of each source, outside the repo, even where
# the environment says not to write it (PYTHONDONTWRITEBYTECODE: 65 s the first time, 52 s
# after, 2026-12-02). `make test` runs the rest.
FAST := not k8s and not e2e and not chaos and not gpu and not torch
test-fast: deps-python
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(RELAYTRAIN_CACHE)/pycache \
	  $(PY) -m pytest tests -m "$(FAST)" -q -p no:cacheprovider $(PYTEST_ARGS)

test-unit: deps-python
	$(PY) -m pytest tests -m "unit" $(PYTEST_ARGS)
test-contract: deps-python
	$(PY) -m pytest tests -m "contract" $(PYTEST_ARGS)
test-k8s: deps
	$(PY) -m pytest tests -m "k8s" $(PYTEST_ARGS)
test-e2e: deps images
	$(PY) -m pytest tests -m "e2e" $(PYTEST_ARGS)
# The chaos schedules: one pipeline's (part of `make test` too), two pipelines' faults and the
# churn of a changing fleet (only here: 3 to 4 minutes each, over the test session's budget):
# what happened, survived, time to recover.
chaos: deps
	$(PY) -m pytest tests -m "chaos" -s $(PYTEST_ARGS)

lint: deps-python deps-binaries
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$$($(PY) -c 'from hack import toolpaths; print(toolpaths.binary("actionlint"))') .github/workflows/*.yml

# The two commands that change what a fresh machine installs; review and commit their diff.
lock:
	@bash hack/bootstrap.sh lock
go-modules:
	@bash hack/update-go-modules.sh

format: deps-python
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

cluster-up: deps
	@bash hack/cluster.sh up

cluster-down:
	@bash hack/cluster.sh down

kubeconfig:
	@bash hack/cluster.sh kubeconfig

# The CRD is generated from the spec models (operator/relaytrain_operator/spec/crd.py) into
# crds/ and the chart's files/crds/: the chart installs it through a template (so
# crds.enabled and crds.keep apply); a chart-level crds/ folder would be installed
# unconditionally. tests/unit/test_crd_schema.py fails when the files are not its output.
CRD_FILE := finetunejobs.relaytrain.io.yaml
crds: deps-python
	$(PY) -m relaytrain_operator.spec.crd crds/$(CRD_FILE) charts/relaytrain/files/crds/$(CRD_FILE)
chart-crds: crds

demo: deps
	@bash hack/demo.sh

# `make bench BENCH_ARGS=--quick` for the short variants.
bench: deps
	@bash hack/bench.sh

# The operator and worker images, without a Docker daemon: buildah into a container storage
# under $(RELAYTRAIN_CACHE) (hack/images.sh; the e2e tier runs stage pods from the worker image).
images:
	@bash hack/images.sh build

# Both images to a registry of your own (`make images push REGISTRY=registry.example.com`):
# relaytrain/operator and relaytrain/worker, tagged with the version; prints each by digest.
push:
	@test -n "$(REGISTRY)" || { echo "make push needs REGISTRY=host[:port][/path]" >&2; exit 2; }
	@bash hack/images.sh push "$(REGISTRY)"

# The GPU check (docs/gpu-check.md): the wheels a GPU host lacks, from uv.lock's pins and
# hashes, into .whl/ (git-ignored), and the one command that host runs
# (`bash hack/gpu-check.sh run`: bench/gpu_check.py --device cuda and the gpu-marked tests).
gpu-check: deps-python
	@bash hack/gpu-check.sh prepare
