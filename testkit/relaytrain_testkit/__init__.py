"""What tests, benchmarks and `make demo` share, kept out of the product's wheel.

- `tiny_models`, `tiny_families`: random tiny models saved like hub checkpoints, with a
  tokenizer trained on the spot (no downloads).
- `random_models`: random models built straight on a device from a config alone (weights
  drawn by name, so slices and the whole model agree): the GPU check's 8B-shaped model.
- `inputs`: the exactness tests' training, layer splits and micro-batches.
- `pipelines`: pipelines run in process (every stage a thread, real loopback links).
- `shaped_links`: commands in a network namespace whose loopback the kernel makes slow.
- `references`: the same training in one process, to compare the pipelines against.
- `replica_links`: replica groups of stages over real loopback links.
- `linkcreds`: link credentials minted as the operator mints them.
- `shapes`: model configs the planner reads.
- `chat_templates`: the published chat templates of the model families.
- `jobs`: the one builder of FineTuneJob manifests (`Job("smol").pipeline(stages=2).build()`).
- `spec_cases`, `stage_pods`, `stage_document`, `decide_cases`, `health_cases`: the
  FineTuneJobs (built with `jobs`), pods, stage documents and statuses several test modules
  build on.
- `local_jobs`: `relaytrain run --local` jobs as child processes.
- `doc_commands`: the commands the documentation shows, and the registry that covers them.
- `harness`: the local cluster, kwok, MinIO, the chart and the operator that the k8s and
  e2e tiers (and `make demo`, and the operator benchmark) run against.

Not installed: pytest puts testkit/ on its path (pyproject.toml), and the scripts in bench/
and hack/ put it there themselves. The worker, the operator and the contract never import
it (an import-linter contract).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root folder."""
