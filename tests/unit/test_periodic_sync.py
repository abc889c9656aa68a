"""Periodic synchronisation's outer step (`periodic.outer_step`) over real threads and links.

Three pipelines split a 4-layer model's LoRA-shaped parameters differently; each stage is a
thread holding its own copy of its layers' parameters, which differ between pipelines (as
after H local steps). One outer step through an `InProcessGroup` or through `LinkGroup`s over
authenticated loopback links leaves every pipeline's copy of every parameter torch.equal to
the others', equal to the token-weighted mean computed here independently in float64, and
replicas that were equal already stay bit for bit what they were.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch
from relaytrain_testkit.replica_links import link_groups, on_threads
from relaytrain_worker.pipeline.stats import ReplicaGroup
from relaytrain_worker.replicas import outer_codec
from relaytrain_worker.replicas.arithmetic import InProcessGroup, Slice
from relaytrain_worker.replicas.periodic import PeriodicSync, is_outer_step, outer_step
from torch import nn

pytestmark = pytest.mark.unit

SPLITS = [[(0, 1), (1, 4)], [(0, 3), (3, 4)], [(0, 2), (2, 4)]]
TOKENS = [37, 11, 80]
"""Label tokens each pipeline trained since the last outer step (unequal on purpose)."""
NAMES = [f"model.layers.{i}.self_attn.{m}.lora_{ab}.weight" for i in range(4)
         for m in ("q_proj", "v_proj") for ab in ("A", "B")]  # fmt: skip


def _value(p: int, name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * p + NAMES.index(name))
    return torch.randn(4, 6, generator=gen)


def _stage_params(p: int, k: int, same: bool) -> list[tuple[str, nn.Parameter]]:
    held = Slice.of(SPLITS[p], k)
    return [
        (n, nn.Parameter(_value(0 if same else p, n).clone()))
        for n in NAMES
        if held.start <= int(n.split(".")[2]) < held.end
    ]


def _outer(
    kind: Literal["memory", "links"], same: bool
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """One outer step of every stage on its own thread; every stage's parameters after it."""
    stages = {
        (p, k): _stage_params(p, k, same) for p, s in enumerate(SPLITS) for k in range(len(s))
    }
    groups = _groups(kind, stages)
    keys = sorted(stages)
    try:
        got = on_threads({
            i: (lambda p=p, k=k: outer_step(
                groups[(p, k)], 3, p, k, stages[(p, k)], weight=TOKENS[p]
            ))
            for i, (p, k) in enumerate(keys)
        })  # fmt: skip
    finally:
        _close(groups)
    errors = [v for v in got.values() if isinstance(v, BaseException)]
    if errors:
        raise errors[0]
    return {key: {n: t.detach().clone() for n, t in params} for key, params in stages.items()}


def _groups(kind: str, stages: dict[tuple[int, int], Any]) -> dict[tuple[int, int], ReplicaGroup]:
    """One `InProcessGroup` shared by every stage (`memory`) or a `LinkGroup` each (`links`)."""
    if kind == "memory":
        shared = InProcessGroup([len(s) for s in SPLITS], timeout=60)
        return {key: shared for key in stages}
    return dict(link_groups(SPLITS))


def _close(groups: dict[tuple[int, int], ReplicaGroup]) -> None:
    for group in groups.values():
        close = getattr(group, "close", None)
        if close is not None:
            close()


def _by_pipeline(
    after: dict[tuple[int, int], dict[str, torch.Tensor]],
) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in SPLITS]
    for (p, _), params in after.items():
        out[p].update(params)
    return out


@pytest.mark.parametrize("kind", ["memory", "links"])
def test_an_outer_step_leaves_every_replica_equal_to_the_token_weighted_mean(kind: str) -> None:
    copies = _by_pipeline(_outer(kind, same=False))  # type: ignore[arg-type]
    total = float(sum(TOKENS))
    for name in NAMES:
        want = sum(TOKENS[p] * _value(p, name).double() for p in range(len(SPLITS))) / total
        for p, params in enumerate(copies):
            assert torch.equal(params[name], copies[0][name]), (p, name)
            assert torch.equal(params[name], want.float()), (p, name)
        assert not torch.equal(copies[0][name], _value(0, name))


@pytest.mark.parametrize("kind", ["memory", "links"])
def test_replicas_already_equal_stay_bit_for_bit_what_they_were(kind: str) -> None:
    copies = _by_pipeline(_outer(kind, same=True))  # type: ignore[arg-type]
    for name in NAMES:
        for params in copies:
            assert torch.equal(params[name], _value(0, name)), name


def test_outer_steps_fall_every_h_steps_and_after_the_last() -> None:
    assert [s for s in range(1, 11) if is_outer_step(s, 4, 10)] == [4, 8, 10]
    assert [s for s in range(1, 9) if is_outer_step(s, 4, 8)] == [4, 8]


# -- outer steps that send codes (`outerCode: int2`) -----------------------------------


def _syncs(
    groups: dict[tuple[int, int], ReplicaGroup],
    stages: dict[tuple[int, int], list[tuple[str, nn.Parameter]]],
) -> dict[tuple[int, int], PeriodicSync]:
    return {
        key: PeriodicSync(groups[key], key[0], key[1], params, every=2, total=10, code="int2")
        for key, params in stages.items()
    }


def _train(stages: dict[tuple[int, int], list[tuple[str, nn.Parameter]]], seed: int) -> None:
    """Local steps: every pipeline's copy moves its own way."""
    with torch.no_grad():
        for (p, _), params in stages.items():
            for name, param in params:
                gen = torch.Generator().manual_seed(seed + 100 * p + NAMES.index(name))
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)


def _coded_outer(syncs: dict[tuple[int, int], PeriodicSync], step: int) -> None:
    got = on_threads({
        i: (lambda key=key: syncs[key].after_step(step, TOKENS[key[0]]))
        for i, key in enumerate(sorted(syncs))
    })  # fmt: skip
    errors = [v for v in got.values() if isinstance(v, BaseException)]
    if errors:
        raise errors[0]


def _held(
    stages: dict[tuple[int, int], list[tuple[str, nn.Parameter]]],
) -> list[dict[str, torch.Tensor]]:
    return _by_pipeline({k: {n: t.detach().clone() for n, t in v} for k, v in stages.items()})


@pytest.mark.parametrize("kind", ["memory", "links"])
def test_a_coded_outer_step_lands_every_replica_on_the_anchor_plus_the_decoded_mean(
    kind: str,
) -> None:
    stages = {
        (p, k): _stage_params(p, k, same=True) for p, s in enumerate(SPLITS) for k in range(len(s))
    }
    groups = _groups(kind, stages)
    try:
        syncs = _syncs(groups, stages)
        _train(stages, 1)
        trained = _held(stages)
        _coded_outer(syncs, 2)
        copies = _held(stages)
    finally:
        _close(groups)
    for name in NAMES:
        anchor = _value(0, name)
        codes = [
            outer_codec.encode(trained[p][name] - anchor, TOKENS[p], 2, 2)[0]
            for p in range(len(SPLITS))
        ]
        want = anchor + outer_codec.weighted_mean(codes, anchor.numel(), 2, 2).reshape(anchor.shape)
        for p, params in enumerate(copies):
            assert torch.equal(params[name], want), (p, name)


def test_a_rejoining_stage_takes_the_anchor_or_its_replicas_drift_apart() -> None:
    def rejoin(take: bool) -> list[dict[str, torch.Tensor]]:
        stages = {
            (p, k): _stage_params(p, k, same=True)
            for p, s in enumerate(SPLITS)
            for k in range(len(s))
        }
        shared = InProcessGroup([len(s) for s in SPLITS], timeout=60)
        syncs = _syncs({key: shared for key in stages}, stages)
        _train(stages, 1)
        _coded_outer(syncs, 2)
        _train(stages, 2)  # pipeline 2 then fails and restarts from stale weights...
        live = {n: t for (p, _), params in stages.items() if p == 0 for n, t in params}
        anchors = {}
        for (p, _), sync in syncs.items():
            if p == 0:
                anchors.update(sync.anchor_tensors(NAMES))
        shared = InProcessGroup([len(s) for s in SPLITS], timeout=60)
        for key in [k for k in stages if k[0] == 2]:
            # ...and rejoins mid-round with pipeline 0's weights (and, with `take`, anchors).
            stages[key] = _stage_params(2, key[1], same=False)
            with torch.no_grad():
                for name, param in stages[key]:
                    param.copy_(live[name])
        syncs = _syncs({key: shared for key in stages}, stages) | {
            key: sync for key, sync in syncs.items() if key[0] != 2
        }
        for key, sync in syncs.items():
            sync.group = shared
            if key[0] == 2 and take:
                sync.take_anchor(anchors)
        _train(stages, 3)
        _coded_outer(syncs, 4)
        return _held(stages)

    copies = rejoin(take=True)
    for name in NAMES:
        for p, params in enumerate(copies):
            assert torch.equal(params[name], copies[0][name]), (p, name)
    drifted = rejoin(take=False)
    assert any(not torch.equal(drifted[2][n], drifted[0][n]) for n in NAMES)


def test_with_weights_on_the_wire_a_rejoining_stage_is_sent_no_anchor() -> None:
    # The default outer step sends weights: the state a live stage hands a rejoining one
    # (its weights) is all there is, so no anchor goes with it and none is asked for.
    # (Until 2026-11-28 the live stage failed building anchors it does not keep.)
    stages = {(p, k): _stage_params(p, k, same=True) for p, s in enumerate(SPLITS)
              for k in range(len(s))}  # fmt: skip
    shared = InProcessGroup([len(s) for s in SPLITS], timeout=60)
    for key, params in stages.items():
        sync = PeriodicSync(shared, key[0], key[1], params, every=2, total=10)
        assert sync.anchor_tensors(NAMES) == {}
        sync.take_anchor({})


def test_over_links_each_holder_gets_the_other_pipelines_codes_not_its_own_back() -> None:
    splits = [[(0, 4)], [(0, 4)]]
    names = [f"model.layers.{i}.mlp.up_proj.lora_B.weight" for i in range(4)]
    groups = dict(link_groups(splits))
    stages = {(p, 0): [(n, nn.Parameter(torch.zeros(64, 64))) for n in names] for p in range(2)}
    try:
        syncs = {
            key: PeriodicSync(groups[key], key[0], 0, params, every=2, total=4, code="int2")
            for key, params in stages.items()
        }
        with torch.no_grad():
            for (p, _), params in stages.items():
                for _, param in params:
                    param.normal_(generator=torch.Generator().manual_seed(p))
        _coded_outer(syncs, 2)
        received = {key: sum(link.bytes_received for link in group.links().values())
                    for key, group in groups.items()}  # fmt: skip
    finally:
        for group in groups.values():
            group.close()
    for name, _ in stages[(0, 0)]:
        assert torch.equal(dict(stages[(0, 0)])[name], dict(stages[(1, 0)])[name])
    # One code per name each way (plus framing): the follower is not sent its own code.
    code = sum(outer_codec.code_bytes(64 * 64, 2) for _ in names)
    assert code <= received[(0, 0)] < 1.5 * code
    assert code <= received[(1, 0)] < 1.5 * code
