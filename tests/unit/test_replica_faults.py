"""A pipeline that leaves takes only itself out: the star reduce over real links.

Every stage here is a `LinkGroup` over mutually authenticated loopback TLS links, each
pipeline's stage on a thread of its own; a pipeline "crashes" by closing every link of its
stage (what a stage does when its pipeline breaks, and what the kernel does for a killed
process). What must hold, whatever the timing: every stage that is still there ends the
step with the same bits (a result anyone has wins), a contribution that never came is
simply absent, a pipeline rejoining is admitted at one step by every first stage, and a
rejoining stage takes a live stage's weights and AdamW state by name, equal bit for bit.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from relaytrain_testkit.replica_links import (
    Peer,
    link_groups,
    link_pair,
    on_threads,
    peer_credentials,
    peer_links,
)
from relaytrain_worker.model.training import named_optimizer_state
from relaytrain_worker.pipeline.linkauth import LinkBroken
from relaytrain_worker.pipeline.transport import Frame
from relaytrain_worker.replicas.arithmetic import Slice, live_shares
from relaytrain_worker.replicas.group import LinkGroup, Membership
from relaytrain_worker.replicas.handover import STATE, load_state_frames, state_frame
from relaytrain_worker.replicas.links import fleet, given_up
from torch import nn

pytestmark = pytest.mark.unit

NAME = "model.layers.0.self_attn.q_proj.lora_A.weight"
ONE_STAGE = [(0, 1)]


def _crash_when_sending_result(group: LinkGroup, to: Peer, after: Peer | None) -> None:
    """Make `group`'s stage die (close every link) instead of sending its result to `to`,
    once the result to `after` is on the wire: a leader dying mid-broadcast."""
    port = group._ports[to]
    send = port.send

    def dying(frame: Frame) -> bool:
        if not frame.kind.startswith("result:"):
            return send(frame)
        if after is not None:
            group._ports[after].flush()
        group.close()
        return False

    port.send = dying  # type: ignore[method-assign]


VALUES = {0: 3.0, 1: 1.0, 2: 2.0}
"""Pipeline p's contribution. The fold of all three is 6, without pipeline 0 it is 3."""


def _contribution(p: int) -> dict[str, torch.Tensor]:
    return {NAME: torch.tensor([VALUES[p]])}


@pytest.mark.parametrize("first", [1, 2])
def test_a_leader_dying_mid_broadcast_leaves_every_survivor_with_its_result(first: int) -> None:
    # Pipeline 0 leads; it sends the result to pipeline `first`, then dies before the other
    # has it. The one that has it keeps it; the other takes it over (from the new leader's
    # cache, or, when it leads itself, by asking first): both hold the fold of all three.
    other = 3 - first
    groups = link_groups([ONE_STAGE] * 3, order={(0, 0): [(first, 0), (other, 0)]})
    _crash_when_sending_result(groups[(0, 0)], to=(other, 0), after=(first, 0))
    got = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(7, p, 0, _contribution(p)) for p in range(3)}
    )
    for group in groups.values():
        group.close()
    assert not isinstance(got[1], BaseException), got[1]
    assert not isinstance(got[2], BaseException), got[2]
    assert torch.equal(got[1][NAME], got[2][NAME])
    assert got[1][NAME].item() == 6.0  # pipeline 0's contribution is in: the result was out
    # Nothing is missing from it, whoever handed it on: the step stands.
    assert not groups[(1, 0)].short(7) and not groups[(2, 0)].short(7)


def test_a_leader_dying_before_any_result_is_replaced_by_the_next_pipeline() -> None:
    # Pipeline 0 dies once it holds both contributions and has sent nothing: pipeline 1
    # takes over, nobody has a result, so it folds again what is there (1 + 2).
    groups = link_groups([ONE_STAGE] * 3)
    _crash_when_sending_result(groups[(0, 0)], to=(1, 0), after=None)
    groups[(0, 0)]._ports[(2, 0)].send = lambda frame: False  # type: ignore[method-assign]
    got = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(3, p, 0, _contribution(p)) for p in range(3)}
    )
    for group in groups.values():
        group.close()
    assert torch.equal(got[1][NAME], got[2][NAME])
    assert got[1][NAME].item() == 3.0
    # Pipeline 0's contribution is missing: both survivors know it, so both redo the step.
    assert groups[(1, 0)].short(3) and groups[(2, 0)].short(3)


def test_a_pipeline_gone_before_contributing_is_simply_absent() -> None:
    groups = link_groups([ONE_STAGE] * 3)
    groups[(2, 0)].close()  # pipeline 2 has left before the step's reduce
    got = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(0, p, 0, _contribution(p)) for p in range(2)}
    )
    for group in groups.values():
        group.close()
    assert torch.equal(got[0][NAME], got[1][NAME])
    assert got[0][NAME].item() == 4.0
    assert groups[(0, 0)].short(0) and groups[(1, 0)].short(0)  # the leader and the led


def test_a_short_steps_redo_is_a_fresh_exchange_among_those_left() -> None:
    # Pipeline 2 leaves in the middle of step 5: the result 3 + 1 misses it (short). The
    # step's next attempt is agreed and reduced under names of its own, so nothing of the
    # first attempt (its cached result, a late frame) answers it.
    groups = link_groups([ONE_STAGE] * 3)
    groups[(2, 0)].close()
    first = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(5, p, 0, _contribution(p)) for p in range(2)}
    )
    assert first[0][NAME].item() == 4.0 and groups[(0, 0)].short(5)
    agreed = on_threads({p: lambda p=p: groups[(p, 0)].agree_members(5, 1) for p in range(2)})
    assert agreed[0] == agreed[1] == ({0, 1}, set(), (1, 1))
    for p in range(2):
        groups[(p, 0)].begin(5, {0, 1}, attempt=1)
    again = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(5, p, 0, _terms(10.0 * p + 1.0)) for p in range(2)}
    )
    for group in groups.values():
        group.close()
    assert again[0][NAME].item() == again[1][NAME].item() == 12.0
    assert not groups[(0, 0)].short(5) and not groups[(1, 0)].short(5)


def test_the_fold_stays_in_pipeline_order_with_every_pipeline_there() -> None:
    # (1 + 1e8) - 1e8 == 0 in float32 but 1 + (1e8 - 1e8) == 1: the leader folds in order.
    values = {0: 1.0, 1: 1e8, 2: -1e8}
    groups = link_groups([ONE_STAGE] * 3)
    got = on_threads(
        {p: lambda p=p: groups[(p, 0)].reduce(0, p, 0, {NAME: torch.tensor([values[p]])})
         for p in (2, 1, 0)}
    )  # fmt: skip
    for group in groups.values():
        group.close()
    # Each contribution is a stack of one term (a `TERMS` exchange): the result is the term.
    want = ((torch.tensor([1.0]) + torch.tensor([1e8])) + torch.tensor([-1e8]))[0]
    assert all(torch.equal(got[p][NAME], want) for p in range(3))
    assert not any(groups[(p, 0)].short(0) for p in range(3))


def _terms(*values: float) -> dict[str, torch.Tensor]:
    return {NAME: torch.tensor(values)}


def test_a_pipeline_with_several_terms_adds_them_onto_the_sum_so_far() -> None:
    # Pipeline 1 trained two micro-batches: added onto pipeline 0's term in order, then
    # pipeline 2's, ((1 + 1e8) - 1e8) + 1 == 1 in float32; pipeline 1 summing its own two
    # first would give 1 + (1e8 - 1e8) + 1 == 2. Pipeline 1 takes a round (`ready`,
    # `prefix`, `sum`): it sends one copy, not two.
    stacks = {0: _terms(1.0), 1: _terms(1e8, -1e8), 2: _terms(1.0)}
    groups = link_groups([ONE_STAGE] * 3)
    sent: dict[str, list[int]] = {}
    for port in groups[(1, 0)]._ports.values():
        send = port.send

        def counting(frame: Frame, send=send) -> bool:  # type: ignore[no-untyped-def]
            sent.setdefault(frame.kind, []).extend(len(t) for t in frame.tensors.values())
            return send(frame)

        port.send = counting  # type: ignore[method-assign]
    got = on_threads({p: lambda p=p: groups[(p, 0)].reduce(3, p, 0, stacks[p]) for p in (2, 1, 0)})
    for group in groups.values():
        group.close()
    assert all(got[p][NAME].item() == 1.0 for p in range(3)), got
    assert sent == {"ready:grads": [], "sum:grads": [1]}


def test_with_two_pipelines_a_round_moves_one_copy_each_way() -> None:
    # The leader sends the sum so far; pipeline 1's sum back is the result, which it keeps
    # (`own`): no third copy, as in a plain star (contribution in, result out).
    stacks = {0: _terms(1.0, 2.0), 1: _terms(1e8, -1e8)}
    groups = link_groups([ONE_STAGE] * 2)
    sent: dict[str, list[int]] = {}
    port = groups[(0, 0)]._ports[(1, 0)]
    send = port.send

    def counting(frame: Frame) -> bool:
        sent.setdefault(frame.kind, []).extend(len(t) for t in frame.tensors.values())
        return send(frame)

    port.send = counting  # type: ignore[method-assign]
    got = on_threads({p: lambda p=p: groups[(p, 0)].reduce(5, p, 0, stacks[p]) for p in (1, 0)})
    for group in groups.values():
        group.close()
    want = ((torch.tensor(1.0) + 2.0) + 1e8) - 1e8  # 0.0 in float32
    assert torch.equal(got[0][NAME], want) and torch.equal(got[1][NAME], want), got
    assert sent == {"prefix:grads": [1], "result:grads": []}


def test_a_pipeline_gone_in_its_round_is_absent_and_the_others_agree() -> None:
    stacks = {0: _terms(3.0), 1: _terms(0.5, 0.5), 2: _terms(2.0)}
    groups = link_groups([ONE_STAGE] * 3)
    port = groups[(1, 0)]._ports[(0, 0)]
    send = port.send

    def dying(frame: Frame) -> bool:
        if frame.kind.startswith("sum:"):
            groups[(1, 0)].close()  # pipeline 1 dies with the sum so far in hand
            return False
        return send(frame)

    port.send = dying  # type: ignore[method-assign]
    got = on_threads({p: lambda p=p: groups[(p, 0)].reduce(4, p, 0, stacks[p]) for p in range(3)})
    for group in groups.values():
        group.close()
    assert isinstance(got[1], LinkBroken), got[1]
    assert got[0][NAME].item() == got[2][NAME].item() == 5.0
    assert groups[(0, 0)].short(4) and groups[(2, 0)].short(4)


def test_a_rejoining_pipeline_is_admitted_by_every_first_stage_at_one_step() -> None:
    splits = [ONE_STAGE] * 3
    creds = peer_credentials(splits)
    groups = {p: g for (p, _), g in link_groups(splits, creds=creds).items()}
    groups[2].close()  # pipeline 2 fails; 0 and 1 train step 10 without it
    left = on_threads({p: lambda p=p: groups[p].agree_members(10) for p in range(2)})
    assert left[0] == left[1] == ({0, 1}, set(), (1, 1))
    # Its new stage links to theirs again (they offer the links to their groups) and asks.
    fresh = {p: link_pair(creds[(p, 0)], creds[(2, 0)]) for p in range(2)}
    for p in range(2):
        groups[p].begin(10, {0, 1})
        groups[p].offer((2, 0), fresh[p][0])
    links = {(p, 0): fresh[p][1] for p in range(2)}
    groups[2] = LinkGroup.from_splits(splits, 2, 0, links, members={0, 1}, timeout=60)
    joined: list[tuple[int, Membership]] = []
    joiner = threading.Thread(target=lambda: joined.append(groups[2].join(60)))
    joiner.start()
    port = groups[0]._offered[(2, 0)]
    with groups[0]._cond:
        assert groups[0]._cond.wait_for(lambda: port.has("join", None), 30)
    got = on_threads({p: lambda p=p: groups[p].agree_members(11) for p in range(2)})
    joiner.join(30)
    assert got[0] == got[1] == ({0, 1, 2}, {2}, (1, 1, 1))
    assert joined == [(11, ({0, 1, 2}, {2}, (1, 1, 1)))]
    # From that step on the three reduce together again.
    for p in range(3):
        groups[p].begin(11, {0, 1, 2}, {2})
    sums = on_threads(
        {p: lambda p=p: groups[p].reduce(11, p, 0, _contribution(p)) for p in range(3)}
    )
    for group in groups.values():
        group.close()
    assert all(sums[p][NAME].item() == 6.0 for p in range(3))


def test_a_pipeline_added_to_the_job_is_admitted_with_its_share_and_takes_its_part() -> None:
    # Pipelines 0 and 1 (4 and 3 of 7 micro-batches) train; pipeline 2, which their
    # documents do not list, is added with a share of 2 (its stage's document lists all three).
    creds = peer_credentials([ONE_STAGE] * 3)
    first_two = {peer: c for peer, c in creds.items() if peer[0] < 2}
    groups = {
        p: g
        for (p, _), g in link_groups(
            [ONE_STAGE] * 2, creds=first_two, shares=[4, 3], slots=7
        ).items()
    }
    before = on_threads({p: lambda p=p: groups[p].agree_members(3) for p in range(2)})
    assert before[0] == before[1] == ({0, 1}, set(), (4, 3))
    assert [before[0].mine(p, 7) for p in range(2)] == [range(0, 4), range(4, 7)]
    for p in range(2):
        groups[p].begin(3, {0, 1})
        groups[p].add_peers({(2, 0): Slice.of(ONE_STAGE, 0)})
        assert groups[p].gone_peers() == [(2, 0)]  # whom the stage now dials
        assert groups[p].pipelines == 3
    fresh = {p: link_pair(creds[(p, 0)], creds[(2, 0)]) for p in range(2)}
    for p in range(2):
        groups[p].offer((2, 0), fresh[p][0])
    links = {(p, 0): fresh[p][1] for p in range(2)}
    groups[2] = LinkGroup.from_splits(
        [ONE_STAGE] * 3, 2, 0, links, members={0, 1}, share=2, slots=7, timeout=60
    )
    joined: list[tuple[int, Membership]] = []
    joiner = threading.Thread(target=lambda: joined.append(groups[2].join(60)))
    joiner.start()
    port = groups[0]._offered[(2, 0)]
    with groups[0]._cond:
        assert groups[0]._cond.wait_for(lambda: port.has("join", None), 30)
    got = on_threads({p: lambda p=p: groups[p].agree_members(4) for p in range(2)})
    joiner.join(30)
    assert got[0] == got[1] == ({0, 1, 2}, {2}, (4, 3, 2))
    assert joined == [(4, got[0])]
    # The 7 micro-batches by D'Hondt's rule over 4:3:2 (quotients 4, 3, 2, 2, 1.5, 1.33,
    # then the tie at 1 to the one with fewest so far), in pipeline order.
    assert [got[0].mine(p, 7) for p in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    for p in range(3):
        groups[p].begin(4, {0, 1, 2}, {2})
    sums = on_threads(
        {p: lambda p=p: groups[p].reduce(4, p, 0, _contribution(p)) for p in range(3)}
    )
    assert all(sums[p][NAME].item() == 6.0 for p in range(3))
    # The grown plan's shares (names.FLEET_FILE: 2, 2, 3; ReplicaLinks.follow sets them):
    # the next step every member agrees on is shared by them.
    for p, share in enumerate([2, 2, 3]):
        groups[p].share = share
    after = on_threads({p: lambda p=p: groups[p].agree_members(5) for p in range(3)})
    for group in groups.values():
        group.close()
    assert after[0] == after[1] == after[2] == ({0, 1, 2}, set(), (2, 2, 3))
    assert [after[0].mine(p, 7) for p in range(3)] == [range(0, 2), range(2, 4), range(4, 7)]


def test_no_more_pipelines_are_added_than_a_membership_mark_holds() -> None:
    group = LinkGroup(2, 0, 0, {(1, 0): Slice.of(ONE_STAGE, 0)}, {}, members={0}, slots=3)
    group.add_peers({(2, 0): Slice.of(ONE_STAGE, 0)})
    with pytest.raises(ValueError, match="no more than 3 pipelines"):
        group.add_peers({(3, 0): Slice.of(ONE_STAGE, 0)})
    with pytest.raises(ValueError, match="not stages of added pipelines"):
        group.add_peers({(0, 1): Slice.of(ONE_STAGE, 0)})


def test_a_pipeline_left_out_of_a_step_no_longer_counts_in_the_next_membership() -> None:
    groups = link_groups([ONE_STAGE] * 3)
    groups[(1, 0)].close()
    got = on_threads({p: lambda p=p: groups[(p, 0)].agree_members(4) for p in (0, 2)})
    for group in groups.values():
        group.close()
    assert got[0] == got[2] == ({0, 2}, set(), (1, 0, 1))


def test_a_break_between_live_pipelines_makes_the_higher_one_leave() -> None:
    groups = link_groups([ONE_STAGE] * 2)
    groups[(0, 0)]._ports[(1, 0)].close()  # only this link breaks; both stages live on
    with groups[(1, 0)]._cond:
        assert groups[(1, 0)]._cond.wait_for(lambda: groups[(1, 0)]._ports[(0, 0)].gone, 30)
    groups[(1, 0)].begin(5, {0, 1})
    groups[(1, 0)].begin(6, {0, 1})
    with pytest.raises(LinkBroken, match="pipeline 1 leaves"):
        groups[(1, 0)].begin(7, {0, 1})
    groups[(0, 0)].begin(7, {0, 1})  # the lower one stays
    for group in groups.values():
        group.close()


# -- the shares of a step among the pipelines there ----------------------------------


def test_a_gone_pipelines_micro_batches_go_to_the_others() -> None:
    assert live_shares([2, 1], {0, 1}) == [2, 1]
    assert live_shares([2, 1], {0}) == [3, 0]
    assert live_shares([2, 1], {1}) == [0, 3]
    # By speed (the shares): pipeline 0, twice as fast, takes the micro-batch of pipeline 1.
    assert live_shares([2, 1, 1], {0, 2}) == [3, 0, 1]
    assert live_shares([4, 2, 2], {1, 2}) == [0, 4, 4]
    for shares, members in (([3, 2, 1], {2}), ([1, 1, 1, 5], {0, 3}), ([2, 2], {1})):
        assert sum(live_shares(shares, members)) == sum(shares)
    # A pipeline added beside the planned ones (3:2 of 5, then one more of weight 2): the
    # five micro-batches by D'Hondt's rule (quotients 3, 2, 2, 1.5, then the tie at 1 to
    # the fewest so far, the lower of two), the added one taking its part from pipeline 0.
    assert live_shares([3, 2, 2], {0, 1, 2}, 5) == [2, 2, 1]
    # A tie goes to the member with fewest so far: all three train with 3 micro-batches.
    assert live_shares([2, 1, 1], {0, 1, 2}, 3) == [1, 1, 1]
    assert live_shares([3, 2, 2], {0, 1}, 5) == [3, 2, 0]
    with pytest.raises(ValueError, match="are not pipelines"):
        live_shares([3, 0], {0, 1}, 3)


# -- a rejoining stage's state ---------------------------------------------------------


def _lora(layers: range, seed: int) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (f"model.layers.{i}.self_attn.{m}_proj.lora_{ab}.weight",
         nn.Parameter(torch.randn(4, 8, generator=gen)))
        for i in layers for m in ("q", "v") for ab in "AB"
    ]  # fmt: skip


def _optimizer(
    params: list[tuple[str, nn.Parameter]],
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW([p for _, p in params], lr=0.01, weight_decay=0.1, foreach=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_a_rejoining_stage_takes_a_live_stages_weights_and_adamw_state_by_name() -> None:
    # The live pipeline holds layers 0-2 on one stage; the rejoining one splits them [0 | 1-2].
    splits = [[(0, 3)], [(0, 1), (1, 3)]]
    groups = link_groups(splits)
    live = _lora(range(3), seed=1)
    opt, sched = _optimizer(live)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for _, param in live:
            param.grad = torch.randn(param.shape, generator=gen)
        opt.step()
        sched.step()
    joiners = {k: _lora(range(*splits[1][k]), seed=10 + k) for k in range(2)}
    opts = {k: _optimizer(joiners[k]) for k in range(2)}
    for k in range(2):
        names = [n for n, _ in live if groups[(0, 0)].holds((1, k), n)]
        assert groups[(0, 0)].send_to((1, k), state_frame(20, live, opt, sched, names))
    for k in range(2):
        frames = [groups[(1, k)].recv_from((0, 0), STATE, 20)]
        load_state_frames(frames, joiners[k], *opts[k])
    for group in groups.values():
        group.close()
    mine = dict(live)
    theirs = {n: p for k in range(2) for n, p in joiners[k]}
    assert sorted(theirs) == sorted(mine)
    assert all(torch.equal(theirs[n], mine[n]) for n in mine)
    state = named_optimizer_state(opt, list(mine))["state"]
    for k in range(2):
        got = named_optimizer_state(opts[k][0], [n for n, _ in joiners[k]])["state"]
        for name, values in got.items():
            assert set(values) == set(state[name]) == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(values[key], state[name][key]) for key in values), name
        assert opts[k][1].state_dict() == sched.state_dict()
    # One more step with the same gradients: the same weights (nothing of the state is missing).
    for k in range(2):
        for name, param in joiners[k]:
            param.grad = torch.full_like(param, 0.5)
            mine[name].grad = torch.full_like(param, 0.5)
        opts[k][0].step()
    opt.step()
    assert all(torch.equal(theirs[n], mine[n]) for n in mine)


def test_a_state_without_every_name_is_refused() -> None:
    splits = [[(0, 3)], [(0, 3)]]
    groups = link_groups(splits)
    live = _lora(range(3), seed=1)
    opt, sched = _optimizer(live)
    groups[(0, 0)].send_to((1, 0), state_frame(1, live, opt, sched, [n for n, _ in live[:4]]))
    frame = groups[(1, 0)].recv_from((0, 0), STATE, 1)
    for group in groups.values():
        group.close()
    joiner = _lora(range(3), seed=3)
    with pytest.raises(LinkBroken, match=r"sent no model\.layers\.1"):
        load_state_frames([frame], joiner, *_optimizer(joiner))


def test_pipelines_given_up_are_no_members_and_need_no_links() -> None:
    # Pipeline 0 was given up (the operator said so through the store): the stages of
    # pipelines 1 and 2 link only to each other and reduce among themselves.
    splits = [ONE_STAGE] * 3
    links = peer_links(splits)
    for link in [*links.pop((0, 0)).values(), *(links[(p, 0)].pop((0, 0)) for p in (1, 2))]:
        link.close()
    peers = {(q, 0): Slice.of(ONE_STAGE, 0) for q in range(3)}
    groups = {
        p: LinkGroup(3, p, 0, {k: v for k, v in peers.items() if k != (p, 0)},
                     links[(p, 0)],
                     members={1, 2}, timeout=60)
        for p in (1, 2)
    }  # fmt: skip
    got = on_threads({p: lambda p=p: groups[p].reduce(0, p, 0, _contribution(p)) for p in (1, 2)})
    for group in groups.values():
        group.close()
    assert torch.equal(got[1][NAME], got[2][NAME])
    assert got[1][NAME].item() == 3.0
    assert not groups[1].short(0)  # a pipeline given up is no member: nothing is missing
    # A member pipeline's link is still required.
    with pytest.raises(ValueError, match="needs links"):
        LinkGroup(3, 1, 0, {k: v for k, v in peers.items() if k != (1, 0)}, {}, members={0, 1})


def test_the_given_up_document_is_polled_and_a_bad_one_counts_as_none() -> None:
    reads: list[bytes | None] = [None, b'{"pipelines": [0]}', b"not json", b'{"pipelines": [0, 2]}']
    polled = given_up(lambda: reads.pop(0), every=0.0)
    assert polled() == frozenset()
    assert polled() == {0}
    assert polled() == {0}  # unreadable: the last answer stands
    assert polled() == {0, 2}
    cached = given_up(lambda: b'{"pipelines": [1]}', every=3600.0)
    assert cached() == {1} and cached() == {1}


def test_the_fleet_document_is_polled_and_a_bad_one_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stage = {"pipeline": 2, "stage": 0, "layerStart": 0, "layerEnd": 4,
             "address": "127.0.0.1:1", "identity": "relaytrain://default/j/p2/s0"}  # fmt: skip
    good = json.dumps({"added": [{"stages": [stage]}]}).encode()
    no_address = json.dumps({"added": [{"stages": [{**stage, "address": None}]}]}).encode()
    reads: list[bytes | None] = [None, good, no_address, no_address, b"{}"]
    polled = fleet(lambda: reads.pop(0), every=0.0)
    assert polled() is None
    first = polled()
    assert first is not None and [a.pipeline for a in first.added] == [2]
    with caplog.at_level("WARNING", logger="relaytrain.replicas"):
        assert polled() == first  # a stage without an address: the last answer stands
        assert polled() == first
    said = [r.getMessage() for r in caplog.records if "added pipelines" in r.getMessage()]
    assert len(said) == 1 and "p2/s0 has no address" in said[0], said  # once, naming it
    empty = polled()
    assert empty is not None and empty.added == ()


def _broken_pipeline_0() -> tuple[dict[Peer, LinkGroup], Any, Any]:
    """Pipeline 0 of two stages ([0-1 | 1-2]) and pipeline 1 of one ([0-2]) in step 4: every
    stage's group, pipeline 0's chain as its stage 0 holds it (`Peers`), and the far end of
    that link (what closing pipeline 0's last stage ends)."""
    from relaytrain_worker.pipeline.peers import Peers

    splits = [[(0, 1), (1, 2)], [(0, 2)]]
    creds = peer_credentials(splits)
    groups = link_groups(splits, creds=creds)
    down, up = link_pair(creds[(0, 0)], creds[(0, 1)])
    for group in groups.values():
        group.begin(4, {0, 1})
    return groups, Peers(None, down), up


def test_a_first_stage_whose_pipeline_broke_leaves_rather_than_hold_the_others_up() -> None:
    # Pipeline 0's last stage died after sending its stage 0 the step's last frame but
    # before its results reached pipeline 1: pipeline 1 redoes step 4 (attempt 1) with
    # pipeline 0 still a member, while pipeline 0's stage 0, which needed nothing more from
    # its neighbour, agrees on step 5. Each would wait for the other (15 minutes); stage 0
    # sees its own pipeline's link ended, leaves (closes its links, as a stage does), and
    # pipeline 1 agrees on its redo alone.
    groups, chain, up = _broken_pipeline_0()
    assert chain.broken() is None  # a live neighbour, quiet
    up.close()  # pipeline 0's last stage dies

    def first_of_pipeline_0() -> None:
        try:
            with groups[(0, 0)].watching(chain.broken):
                groups[(0, 0)].agree_members(5)
        finally:
            groups[(0, 0)].close()

    got = on_threads(
        {0: first_of_pipeline_0, 1: lambda: groups[(1, 0)].agree_members(4, attempt=1)}
    )
    chain.close()
    for group in groups.values():
        group.close()
    assert isinstance(got[0], LinkBroken), got[0]
    assert "the link to the next stage of this pipeline ended: pipeline 0 leaves step 5" in str(
        got[0]
    )
    assert not isinstance(got[1], BaseException), got[1]
    assert got[1].members == {1}


def test_a_stage_whose_pipeline_broke_leaves_a_reduce_the_others_lead_without_it() -> None:
    # Pipeline 0's stage 1 died before pipeline 1's stage reached the step's reduce: that
    # stage, linked to both of pipeline 0's, counts pipeline 0 gone and leads every name it
    # holds, waiting for what pipeline 0's stage 0 holds; that stage 0, alive, leads its own
    # names and waits for pipeline 1's contribution. It sees its pipeline link ended and
    # leaves; pipeline 1 folds alone, marked short (the step is trained again).
    groups, chain, up = _broken_pipeline_0()
    groups[(0, 1)].close()  # pipeline 0's last stage dies: its links end
    up.close()
    deadline = time.monotonic() + 30
    while groups[(1, 0)].live(0) and time.monotonic() < deadline:  # its reader saw the end
        time.sleep(0.01)
    assert not groups[(1, 0)].live(0)
    layer_1 = NAME.replace("layers.0.", "layers.1.")

    def first_of_pipeline_0() -> dict[str, torch.Tensor]:
        try:
            with groups[(0, 0)].watching(chain.broken):
                return groups[(0, 0)].reduce(4, 0, 0, {NAME: torch.tensor([3.0])})
        finally:
            groups[(0, 0)].close()

    both = {NAME: torch.tensor([1.0]), layer_1: torch.tensor([2.0])}
    got = on_threads({0: first_of_pipeline_0, 1: lambda: groups[(1, 0)].reduce(4, 1, 0, both)})
    chain.close()
    for group in groups.values():
        group.close()
    assert isinstance(got[0], LinkBroken), got[0]
    assert not isinstance(got[1], BaseException), got[1]
    assert {n: float(t) for n, t in got[1].items()} == {NAME: 1.0, layer_1: 2.0}
    assert groups[(1, 0)].short(4)
