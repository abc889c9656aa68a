"""Periodic synchronisation trains as its definition says (`sync: periodic`, periodic.py).

Two pipelines split a 4-layer model differently and share each step's micro-batches 2:1;
each takes its own AdamW steps on its share (its loss normalised by its share's label
tokens, clipped by its own norm), and every H steps (and after the last) every replica's
weights become the token-weighted mean. Against `run_periodic_reference` — one unsplit
model per pipeline in one process, averaged by the definition — the whole step's losses
and pipeline 0's weights after every step match, every replica is bit-identical after each
outer step, and the comparison fails when the outer step's weights are not the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from relaytrain_testkit.inputs import CLIPPED_TRAINING, masked_batches
from relaytrain_testkit.linkcreds import pipeline_credentials
from relaytrain_testkit.pipelines import PipelineRun, run_data_parallel_threads
from relaytrain_testkit.references import run_periodic_reference
from relaytrain_testkit.tiny_models import tiny_model_dir
from relaytrain_worker.replicas.periodic import PeriodicSync
from relaytrain_worker.state.data import MicroBatch

pytestmark = pytest.mark.unit

TRAINING = CLIPPED_TRAINING
SPLITS = [[(0, 1), (1, 4)], [(0, 3), (3, 4)]]
SHARES = [2, 1]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("llama"), layers=4)


@pytest.fixture(scope="module")
def steps() -> list[list[MicroBatch]]:
    return masked_batches(4, 3)


def _run(
    model_dir: Path,
    steps: list[list[MicroBatch]],
    every: int,
    *,
    splits: list[list[tuple[int, int]]] = SPLITS,
    method: Literal["lora", "full"] = "lora",
    replicas: Literal["memory", "links"] = "memory",
    code: str = "float64",
    exact: bool = False,
) -> list[PipelineRun]:
    return run_data_parallel_threads(
        model_dir, splits, SHARES, steps, TRAINING,
        credentials=pipeline_credentials([len(s) for s in splits]), method=method,
        replicas=replicas, sync_every=every, sync_code=code, sync_exact=exact,
    )  # fmt: skip


def _outer_steps(n: int, every: int) -> list[int]:
    """0-based indices of the steps that end with an outer step."""
    return [s for s in range(n) if (s + 1) % every == 0 or s + 1 == n]


def _assert_periodic(
    runs: list[PipelineRun], ref: PipelineRun, every: int, *, atol: float = 0.0
) -> None:
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if atol == 0 else torch.allclose(a, b, rtol=0, atol=atol)

    n = len(ref.losses)
    # Every pipeline's last stage reports the whole step's loss.
    for run in runs:
        assert run.losses == pytest.approx(ref.losses, rel=0, abs=max(atol, 1e-12))
    # Pipeline 0 holds the reference's weights after every step, averaged or not.
    for s in range(n):
        assert set(runs[0].step_params[s]) == set(ref.step_params[s])
        for name, value in ref.step_params[s].items():
            assert same(runs[0].step_params[s][name], value), (s, name)
    # After each outer step every replica holds the same bits.
    for s in _outer_steps(n, every):
        for run in runs[1:]:
            for name, value in runs[0].step_params[s].items():
                assert torch.equal(run.step_params[s][name], value), (s, name)


@pytest.mark.parametrize("every", [1, 2])
def test_lora_pipelines_average_every_h_steps_as_the_definition_says(
    llama_dir: Path, steps: list[list[MicroBatch]], every: int
) -> None:
    ref = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, every)
    runs = _run(llama_dir, steps, every)
    _assert_periodic(runs, ref, every)
    if every == 2:  # between outer steps (after the warm-up's lr 0) the replicas differ
        first, second = runs[0].step_params[2], runs[1].step_params[2]
        assert any(not torch.equal(value, second[name]) for name, value in first.items())


def test_the_outer_step_over_replica_links_gives_the_same_bits(
    llama_dir: Path, steps: list[list[MicroBatch]]
) -> None:
    ref = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2)
    _assert_periodic(_run(llama_dir, steps, 2, replicas="links"), ref, 2)


@pytest.mark.parametrize("replicas", ["memory", "links"])
def test_coded_outer_steps_follow_their_definition(
    llama_dir: Path, steps: list[list[MicroBatch]], replicas: Literal["memory", "links"]
) -> None:
    # `outerCode: int2`: each pipeline sends its update as a 2-bit code (its residual kept),
    # every pipeline decodes every code and lands on the same bits as the reference.
    ref = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2, code="int2")
    runs = _run(llama_dir, steps, 2, replicas=replicas, code="int2")
    _assert_periodic(runs, ref, 2)
    # The code is lossy: the weights after the first outer step are not the exact mean's.
    exact = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2)
    assert any(
        not torch.equal(runs[0].step_params[1][n], v) for n, v in exact.step_params[1].items()
    )


@pytest.mark.parametrize("code", ["float64", "int4"])
def test_full_training_of_a_tied_model_with_a_one_stage_pipeline(
    llama_dir: Path, steps: list[list[MicroBatch]], code: str
) -> None:
    # Pipeline 1 is one stage holding the embedding and the head, which are one weight: it
    # averages it under both names, so the two-stage pipeline's two copies stay one value.
    splits = [[(0, 2), (2, 4)], [(0, 4)]]
    # With a code, both names of the shared weight send the same code.
    ref = run_periodic_reference(
        llama_dir, SHARES, steps[:2], TRAINING, 2, method="full", code=code
    )
    runs = _run(llama_dir, steps[:2], 2, splits=splits, method="full", code=code)
    _assert_periodic(runs, ref, 2, atol=1e-6)


def test_an_outer_step_weighted_by_anything_but_the_tokens_fails_the_comparison(
    llama_dir: Path, steps: list[list[MicroBatch]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2)
    after_step = PeriodicSync.after_step

    def one_per_step(self: PeriodicSync, step: int, tokens: int) -> bool:
        return after_step(self, step, 1)  # a plain mean of the pipelines

    monkeypatch.setattr(PeriodicSync, "after_step", one_per_step)
    runs = _run(llama_dir, steps, 2)
    with pytest.raises(AssertionError):
        _assert_periodic(runs, ref, 2, atol=1e-6)


@pytest.mark.parametrize(("code", "replicas"), [("float64", "links"), ("int2", "memory")])
def test_the_exact_lora_merge_follows_its_definition(
    llama_dir: Path, code: str, replicas: Literal["memory", "links"]
) -> None:
    # `loraMerge: exact`: every replica's layer becomes the token-weighted mean of the
    # pipelines' layers, B and A their means and the rest folded into the frozen weight.
    # The losses after each outer step see the folded weights: they match the reference's
    # to the bit only when the fold is right.
    steps = masked_batches(6, 3)
    ref = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2, code=code, merge="exact")
    runs = _run(llama_dir, steps, 2, code=code, exact=True, replicas=replicas)
    _assert_periodic(runs, ref, 2)
    # Averaging the factors one by one trains other weights. At the first outer step every
    # A is still its initialisation (B starts at zero, so A's first gradient is zero) and
    # nothing is folded; from the second on the two merges part.
    naive = run_periodic_reference(llama_dir, SHARES, steps, TRAINING, 2, code=code)
    assert naive.losses[:4] == ref.losses[:4]
    assert naive.losses[4:] != pytest.approx(ref.losses[4:], rel=1e-9)
