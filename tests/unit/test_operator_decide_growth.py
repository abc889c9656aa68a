"""A running job of `replicas: auto` grows: a pipeline its plan did not have is added on
GPUs that joined, where the planner says it pays (domain/growing.py, decide/grow.py), with
certificates for its stages (linkcerts.mint_link_extension) and the stages training told
through the store (names.FLEET_FILE) before its pods exist."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from relaytrain_contract import CONFIG_ENV, FleetDocument, link_identity
from relaytrain_operator.domain.builders.secret import build_link_secret
from relaytrain_operator.domain.linkcerts import (
    CA_FILE,
    cert_file,
    extended_files,
    link_state,
    mint_link_credentials,
    mint_link_extension,
    state_annotations,
)
from relaytrain_operator.domain.status import to_manifest
from relaytrain_operator.loop.actions import (
    Create,
    DeletePod,
    ExtendLinkSecret,
    PatchStatus,
    PostEvent,
    PutFleet,
    PutPlan,
)
from relaytrain_operator.loop.decide import (
    WAITING_ANNOTATION,
    Decision,
    ModelConfig,
    decide,
    needs,
    stage_pods,
)
from relaytrain_testkit.decide_cases import JOB, NODES, NOW, SETTINGS, node, observed
from relaytrain_testkit.decide_fleet import (
    AUTO_8B,
    AUTO_STEPS,
    LLAMA_8B,
    aged,
    far_a100,
    fleet,
    replacement_waiting,
)
from relaytrain_testkit.decide_views import Progress

pytestmark = pytest.mark.unit

STEPS, BIG = AUTO_STEPS, AUTO_8B
LIFE = timedelta(days=30)


def progress(step: int) -> Progress:
    """progress.json at `step` of the job's STEPS."""
    return Progress(status={"step": step, "totalSteps": STEPS}, done=False, output=None)


def h100(i: int) -> dict[str, Any]:
    """An H100 that joins pool h100 (zone b, beside NODES' own)."""
    return node(f"h100-{i}", "h100", zone="b")


def secret(files: dict[str, str], version: str = "7") -> dict[str, Any]:
    """The job's link Secret holding `files`, as the API server returns it."""
    return build_link_secret(JOB.build(), files, state_annotations(link_state(files, {})), version)


def training(
    job_t: Any = BIG, nodes: list[dict[str, Any]] = NODES
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
    """`job_t` planned on `nodes` and running, its link certificates read once (Current)
    and its progress at step 40: the job as stored, its pods and its Secret's files."""
    job, pods = fleet(job_t, LLAMA_8B, nodes)
    plan = job["status"]["plan"]
    counts = [len(p["stages"]) for p in plan.get("pipelines") or [{"stages": plan["stages"]}]]
    files = mint_link_credentials("ns", "j", counts, now=NOW - timedelta(days=1), lifetime=LIFE)
    seen = decide(
        observed(job, pods, nodes=nodes, model=LLAMA_8B, progress=progress(40),
                 link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert seen.status is not None
    stored = copy.deepcopy(job)
    stored["status"] = to_manifest(seen.status)
    return stored, pods, files


def grow_pass(
    job: dict[str, Any], pods: list[dict[str, Any]], files: dict[str, str], *joined: Any
) -> Decision:
    nodes = [*NODES, *joined]
    return decide(
        observed(job, pods, nodes=nodes, model=LLAMA_8B, progress=progress(40),
                 link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip


def test_a_job_of_replicas_auto_adds_a_pipeline_on_a_gpu_that_joined_where_it_pays() -> None:
    job, pods, files = training()
    before = job["status"]["plan"]["pipelines"]
    assert len(before) == 3
    assert needs(job, stage_pods(pods), NOW).room  # it looks for GPUs that joined
    grown = grow_pass(job, pods, files, h100(1))
    kinds = [type(a).__name__ for a in grown.actions]
    # The record first, then the certificates, then the store, then the pod.
    assert kinds.index("PatchStatus") < kinds.index("ExtendLinkSecret")
    assert kinds.index("ExtendLinkSecret") < kinds.index("PutFleet") < kinds.index("Create")
    created = [a.obj for a in grown.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p3-s0"]
    assert created[0]["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    # The record: a fourth pipeline, added at step 40, every share planned again.
    assert grown.status is not None and grown.status.plan is not None
    plan = grown.status.plan
    assert plan.pipelines is not None and len(plan.pipelines) == 4
    assert [s.pool for s in plan.pipelines[3].stages] == ["h100"]
    shares = [p.micro_batches for p in plan.pipelines]
    assert sum(shares) == 64 and min(shares) >= 1
    assert plan.predicted_tokens_per_second is not None
    assert plan.predicted_tokens_per_second >= 1.05 * before_tokens(job)
    life = grown.status.pipelines
    assert life is not None and [p.index for p in life] == [0, 1, 2, 3]
    assert (life[3].phase, life[3].added_at_step) == ("Pending", 40)
    assert [p.micro_batches for p in life] == shares
    assert all(p.added_at_step is None for p in life[:3])
    # Its stage's document lists every pipeline, with every share.
    env = {e["name"]: e.get("value") for e in created[0]["spec"]["containers"][0]["env"]}
    doc = json.loads(env[CONFIG_ENV])
    assert doc["replicas"]["pipeline"] == 3 and doc["replicas"]["shares"] == shares
    # Certificates for its stage, under a CA of their own, valid as long as the job's.
    (extend,) = [a for a in grown.actions if isinstance(a, ExtendLinkSecret)]
    assert extend.stages == ((3, 0),) and extend.resource_version == "7"
    assert extend.not_after == link_state(files, {}).not_after
    # The stages training are told where it listens, and who it is.
    (told,) = [a for a in grown.actions if isinstance(a, PutFleet)]
    fleet_doc = FleetDocument.from_json(json.dumps(told.document).encode())
    assert fleet_doc.shares == tuple(shares)  # the stages training take theirs from it
    (added,) = fleet_doc.added
    (peer,) = added.stages
    assert (peer.pipeline, peer.stage) == (3, 0)
    assert peer.identity == link_identity("ns", "j", 3, 0)
    assert peer.address is not None and peer.address.startswith("j-p3-s0.j.ns.svc")
    # The Event says where, its share and the prediction; it counts as an added pipeline.
    (said,) = [a for a in grown.actions if isinstance(a, PostEvent) and a.reason == "PipelineAdded"]
    assert said.change == "added"
    assert grown.status.growth is None  # the free GPUs it priced are used now
    assert said.message.startswith(
        f"Pipeline 3 is added after step 40 on GPUs free for the job (h100), {shares[3]} of each "
        "step's 64 micro-batches: adding 1 "
    )
    assert "predicted tokens/s" in said.message


def before_tokens(job: dict[str, Any]) -> float:
    return float(job["status"]["plan"]["predictedTokensPerSecond"])


def test_no_pipeline_is_added_where_it_does_not_pay_or_the_user_fixed_the_count() -> None:
    job, pods, files = training()
    # An A100 behind 100 Mbit/s: the adapters' sync would cost more than its micro-batches
    # bring.
    slow = grow_pass(job, pods, files, far_a100(100))
    assert not [a for a in slow.actions if isinstance(a, Create | PutFleet | ExtendLinkSecret)]
    assert slow.status is not None and slow.status.plan is not None
    assert slow.status.plan.pipelines is not None and len(slow.status.plan.pipelines) == 3
    # Why the free GPUs stay unused: in status, and in an Event once per set of GPUs.
    growth = slow.status.growth
    assert growth is not None and growth.free_gpus == "far x1, rtx x1"  # the RTX: too small
    assert growth.reason == "no pipeline on the free GPUs would shorten the step"
    (said,) = [a for a in slow.actions if isinstance(a, PostEvent)]
    assert said.reason == "GrowthDeclined"
    assert said.message == (
        f"No pipeline is added on the GPUs free for the job (far x1, rtx x1): {growth.reason}."
    )
    slow_job = copy.deepcopy(job)
    slow_job["status"] = to_manifest(slow.status)
    again = grow_pass(slow_job, pods, files, far_a100(100))
    assert not [a for a in again.actions if isinstance(a, PostEvent)]
    assert not [a for a in again.actions if isinstance(a, PatchStatus)]  # nothing new to say
    # No GPU free any more (the far A100 and the RTX gone): nothing to say.
    taken = [n for n in NODES if n["metadata"]["name"] != "rtx-0"]
    full = decide(
        observed(slow_job, pods, nodes=taken, model=LLAMA_8B, progress=progress(40),
                 link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert full.status is not None and full.status.growth is None
    # Near its end the join would cost more than it saves.
    near = copy.deepcopy(job)
    near_pass = decide(
        observed(near, pods, nodes=[*NODES, h100(1)], model=LLAMA_8B,
                 progress=progress(STEPS - 1), link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert not [a for a in near_pass.actions if isinstance(a, Create)]
    # A fixed count is what the user asked for: the job keeps it.
    fixed = copy.deepcopy(job)
    fixed["spec"]["pipeline"]["replicas"] = 3
    assert not needs(fixed, stage_pods(pods), NOW).room
    kept = grow_pass(fixed, pods, files, h100(1))
    assert not [a for a in kept.actions if isinstance(a, Create)]
    # A pipeline still starting comes first: no growth until every one trains.
    starting = copy.deepcopy(job)
    starting["status"]["pipelines"][1]["phase"] = "Pending"
    assert not needs(starting, stage_pods(pods), NOW).room
    # Under a renewal of the links' certificates: not before it ends.
    renewing = copy.deepcopy(job)
    renewing["status"]["linkCertificates"]["phase"] = "Trusting"
    assert not needs(renewing, stage_pods(pods), NOW).room


def test_an_added_stage_without_a_pod_or_certificate_gets_both_after_a_stopped_pass() -> None:
    job, pods, files = training()
    grown = grow_pass(job, pods, files, h100(1))
    patch = next(a for a in grown.actions if isinstance(a, PatchStatus))
    # The operator stopped after writing the record: the next pass finds the added stage
    # planned, without its pod or its certificate, and makes both, telling the store first.
    stopped = copy.deepcopy(job)
    stopped["status"] = to_manifest(patch.status)
    assert needs(stopped, stage_pods(pods), NOW).link_secret
    again = grow_pass(stopped, pods, files, h100(1))
    kinds = [type(a).__name__ for a in again.actions]
    assert kinds.index("ExtendLinkSecret") < kinds.index("PutFleet") < kinds.index("Create")
    assert "PipelineAdded" not in [a.reason for a in again.actions if isinstance(a, PostEvent)]
    # With its certificate in the Secret, nothing more is minted.
    (extend,) = [a for a in again.actions if isinstance(a, ExtendLinkSecret)]
    more = mint_link_extension("ns", "j", extend.stages, now=NOW, not_after=extend.not_after,
                               generation=extend.generation)  # fmt: skip
    done = grow_pass(stopped, pods, extended_files(files, more), h100(1))
    assert not [a for a in done.actions if isinstance(a, ExtendLinkSecret)]


def test_added_certificates_chain_to_a_ca_every_stage_trusts_and_expire_with_the_jobs() -> None:
    files = mint_link_credentials("ns", "j", [2, 1], now=NOW, lifetime=LIFE)
    state = link_state(files, {})
    minted = mint_link_extension("ns", "j", [(2, 0), (2, 1)], now=NOW + timedelta(days=3),
                                 not_after=state.not_after, generation=0)  # fmt: skip
    grown = extended_files(files, minted)
    assert {n for n in grown} - set(files) == {
        cert_file(2, 0),
        cert_file(2, 1),
        "p2-s0.key",
        "p2-s1.key",
    }
    cas = x509.load_pem_x509_certificates(grown[CA_FILE].encode())
    assert len(cas) == 2  # the job's, then the added stages'
    for p, k in [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]:
        cert = x509.load_pem_x509_certificate(grown[cert_file(p, k)].encode())
        issuer = next(ca for ca in cas if ca.subject == cert.issuer)
        key = issuer.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey)
        cert.verify_directly_issued_by(issuer)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            link_identity("ns", "j", p, k)
        ]
        assert cert.not_valid_after_utc == state.not_after
    assert cas[1].subject != cas[0].subject
    assert link_state(grown, {}) == state  # the renewal's clock is the job's certificates'


def test_the_store_is_told_again_before_an_added_stage_is_replaced_and_only_then() -> None:
    job, pods, files = training()
    grown = grow_pass(job, pods, files, h100(1))
    assert grown.status is not None
    job["status"] = to_manifest(grown.status)
    (added,) = run_pods_of(grown, "h100-1")
    ends = link_state(files, {}).not_after
    more = mint_link_extension("ns", "j", [(3, 0)], now=NOW, not_after=ends, generation=0)
    files = extended_files(files, more)
    alive = [*pods, added]
    # A stage of a pipeline of the plan replaced: nothing to tell.
    lost = grow_pass(job, [p for p in alive if p["metadata"]["name"] != "j-p0-s0"], files, h100(1))
    assert "Create" in [type(a).__name__ for a in lost.actions]
    assert not [a for a in lost.actions if isinstance(a, PutFleet | ExtendLinkSecret)]
    # The added one replaced: the store names it again before its pod is created.
    again = grow_pass(job, [p for p in alive if p["metadata"]["name"] != "j-p3-s0"], files, h100(1))
    kinds = [type(a).__name__ for a in again.actions]
    assert kinds.index("PutFleet") < kinds.index("Create")


def test_a_job_that_cannot_be_priced_does_not_grow() -> None:
    job, pods, files = training()
    unread = decide(
        observed(job, pods, nodes=[*NODES, h100(1)], model=ModelConfig(error="timed out"),
                 progress=progress(40), link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert not [a for a in unread.actions if isinstance(a, Create)]
    # A stage on a pool no node makes any more (its nodes relabelled): not priced, kept.
    relabelled = copy.deepcopy(job)
    relabelled["status"]["stages"][0]["pool"] = "gone"
    kept = grow_pass(relabelled, pods, files, h100(1))
    assert not [a for a in kept.actions if isinstance(a, Create)]


def run_pods_of(decision: Decision, node_name: str) -> list[dict[str, Any]]:
    """The pods `decision` created, bound to `node_name` and Running."""
    out = []
    for a in decision.actions:
        if isinstance(a, Create) and a.obj["kind"] == "Pod":
            p = copy.deepcopy(a.obj)
            p["metadata"]["uid"] = f"uid-{p['metadata']['name']}"
            p["spec"]["nodeName"] = node_name
            p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
            out.append(p)
    return out


def out_for_good(p: int, *, return_after: int = 0, ago: int = 600) -> tuple[Any, Any, Any]:
    """BIG training, its pipeline `p` given up `ago` seconds ago (its pod gone), under a
    policy that tries a given-up pipeline again after `return_after` s (0: never)."""
    job, pods, files = training(BIG.failure_policy(return_after_seconds=return_after))
    job["status"]["pipelines"][p].update(
        phase="Failed", leftTime=(NOW - timedelta(seconds=ago)).isoformat().replace("+00:00", "Z"),
        leftAtStep=30, leftReason="Stage 0 used up its 3 restarts.",
    )  # fmt: skip
    return job, [x for x in pods if not x["metadata"]["name"].startswith(f"j-p{p}-")], files


def test_a_job_grows_past_a_pipeline_given_up_for_good_and_not_on_its_nodes() -> None:
    job, pods, files = out_for_good(2)
    last_ran = next(s["node"] for s in job["status"]["stages"] if s.get("pipeline") == 2)
    assert last_ran.startswith("a100-")  # free now, and never built on again
    assert needs(job, stage_pods(pods), NOW).room
    grown = grow_pass(job, pods, files, h100(1))
    created = [a.obj for a in grown.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p3-s0"]  # a new index: 2 stays out
    assert created[0]["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    assert grown.status is not None and grown.status.plan is not None
    plan = grown.status.plan
    assert plan.pipelines is not None and [p.index for p in plan.pipelines] == [0, 1, 2, 3]
    shares = [p.micro_batches for p in plan.pipelines]
    before = [p["microBatches"] for p in job["status"]["plan"]["pipelines"]]
    # The pipelines training and the added one fill the step; pipeline 2 keeps its share,
    # the weight it would come back with.
    assert shares[2] == before[2] and shares[0] + shares[1] + shares[3] == 64
    life = grown.status.pipelines
    assert life is not None
    assert [p.phase for p in life] == ["Running", "Running", "Failed", "Pending"]
    env = {e["name"]: e.get("value") for e in created[0]["spec"]["containers"][0]["env"]}
    assert json.loads(env[CONFIG_ENV])["replicas"]["shares"] == shares  # adds up past 64
    (told,) = [a for a in grown.actions if isinstance(a, PutFleet)]
    assert told.document["shares"] == shares
    (said,) = [a for a in grown.actions if isinstance(a, PostEvent) and a.reason == "PipelineAdded"]
    assert f"{shares[3]} of each step's 64 micro-batches" in said.message
    # Its GPU alone free (no node joined): nothing is built where it failed.
    alone = grow_pass(job, pods, files)
    assert not [a for a in alone.actions if isinstance(a, Create)]


def test_a_pipeline_that_may_still_come_back_holds_growth_off_and_then_comes_back() -> None:
    # Given up a minute ago, tried again after five: its GPUs are not built on meanwhile.
    job, pods, files = out_for_good(2, return_after=300, ago=60)
    waiting = grow_pass(job, pods, files, h100(1))
    assert not [a for a in waiting.actions if isinstance(a, Create | PutFleet)]
    # Its delay over, it comes back (on the A100 it had), and nothing is added beside it.
    due, pods, files = out_for_good(2, return_after=300, ago=400)
    back = grow_pass(due, pods, files, h100(1))
    created = [a.obj for a in back.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p2-s0"]
    assert "PipelineAdded" in [a.reason for a in back.actions if isinstance(a, PostEvent)]
    assert back.status is not None and back.status.plan is not None
    assert back.status.plan.pipelines is not None and len(back.status.plan.pipelines) == 3
    # A pipeline that left but whose pods are still going holds it off too: their GPUs are
    # not free yet.
    left = copy.deepcopy(job)
    left["status"]["pipelines"][2].update(phase="Left", leftReason="drained")
    job_pods = training()[1]
    going = grow_pass(left, job_pods, files, h100(1))
    assert not [a for a in going.actions if isinstance(a, Create | PutFleet)]


def test_a_job_of_one_pipeline_grows_by_restarting_as_pipeline_0_beside_the_added_one() -> None:
    # Only the H100 at the start: `auto` plans one pipeline, its stages' documents without
    # replicas to grow by.
    start = [n for n in NODES if n["metadata"]["name"] == "h100-0"]
    job, pods, files = training(BIG, start)
    assert "pipelines" not in job["status"]["plan"] and job["status"].get("pipelines") is None
    assert [p["metadata"]["name"] for p in pods] == ["j-stage-0"]
    assert needs(job, stage_pods(pods), NOW).room  # it looks for GPUs that joined
    job["status"]["stages"][0]["lastFailure"] = "OOMKilled"  # kept: the budget is not reset
    # An H100 joins. Growing costs a restart of the job's pipeline (its documents change),
    # from its last commit at step 36: priced, it pays.
    at = Progress(status={"step": 40, "totalSteps": STEPS, "lastCommittedStep": 36},
                  done=False, output=None)  # fmt: skip
    seen = [*start, h100(1)]
    grown = decide(
        observed(job, pods, nodes=seen, model=LLAMA_8B, progress=at, link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    kinds = [type(a).__name__ for a in grown.actions]
    # The plan of two pipelines first, then the one pipeline's pod goes; no pod is created
    # in this pass.
    assert kinds.index("PatchStatus") < kinds.index("DeletePod")
    assert "Create" not in kinds
    assert grown.status is not None and grown.status.plan is not None
    plan = grown.status.plan
    assert plan.pipelines is not None and [p.index for p in plan.pipelines] == [0, 1]
    assert [s.pool for s in plan.pipelines[0].stages] == ["h100"]  # where it ran
    assert [s.pool for s in plan.pipelines[1].stages] == ["h100"]
    assert sum(p.micro_batches for p in plan.pipelines) == 64
    life = grown.status.pipelines
    assert life is not None and [(p.phase, p.added_at_step) for p in life] == [
        ("Pending", None), ("Pending", 40),
    ]  # fmt: skip
    assert [(s.pipeline, s.index, s.last_failure) for s in grown.status.stages] == [
        (0, 0, "OOMKilled"), (1, 0, None),
    ]  # fmt: skip
    ready = next(c for c in grown.status.conditions if c.type == "Ready")
    assert (grown.status.phase, ready.reason) == ("Recovering", "Replanned")
    assert grown.status.plan_epoch == 1  # every stage replaced: the plan's epoch moves on
    (said,) = [a for a in grown.actions if isinstance(a, PostEvent) and a.reason == "PipelineAdded"]
    assert said.change == "added"
    assert said.message.startswith("Pipeline 1 is added after step 40 on GPUs free for the job")
    assert "restores the last commit (step 36; the 4 steps since are trained again)" in (
        said.message
    )
    # With progress.json unread this pass, the record's progress prices the restart (no
    # commit recorded there yet: every step since the start is trained again).
    unread = decide(
        observed(job, pods, nodes=seen, model=LLAMA_8B, link_secret=secret(files)), SETTINGS
    )
    (told,) = [
        a for a in unread.actions if isinstance(a, PostEvent) and a.reason == "PipelineAdded"
    ]
    assert "restores the last commit (the start; the 40 steps since are trained again)" in (
        told.message
    )
    # The next pass: the one pipeline's pod, still going, is waited for (no failure
    # counted); once gone, both pipelines' pods are created, certificates for the added
    # stage first, every document listing both pipelines.
    job["status"] = to_manifest(grown.status)
    going = copy.deepcopy(pods)
    going[0]["metadata"]["deletionTimestamp"] = NOW.isoformat()
    waiting = decide(
        observed(job, going, nodes=seen, model=LLAMA_8B, progress=at, link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert waiting.status is not None
    assert [s.restarts for s in waiting.status.stages] == [0, 0]
    created = [a.obj for a in waiting.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p1-s0"]
    # Before the first of the new plan's pods, the job's store names that plan's stages
    # as its writers: the one pipeline's stage, going, writes no checkpoint from then on.
    kinds = [
        "Pod" if isinstance(a, Create) and a.obj["kind"] == "Pod" else type(a).__name__
        for a in waiting.actions
    ]
    (named,) = [a for a in waiting.actions if isinstance(a, PutPlan)]
    assert named.document["epoch"] == 1 and kinds.index("PutPlan") < kinds.index("Pod")
    gone = decide(
        observed(job, [], nodes=seen, model=LLAMA_8B, progress=at, link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    kinds = [type(a).__name__ for a in gone.actions]
    assert kinds.index("ExtendLinkSecret") < kinds.index("Create")
    created = [a.obj for a in gone.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert sorted(p["metadata"]["name"] for p in created) == ["j-p0-s0", "j-p1-s0"]
    for pod in created:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        doc = json.loads(env[CONFIG_ENV])
        assert doc["replicas"]["shares"] == [p.micro_batches for p in plan.pipelines]
        assert doc["job"]["planEpoch"] == 1
    # An operator stopped before the deletion finds the one pipeline's pod under its old
    # name on its next pass, and removes it (no failure counted).
    stale = decide(
        observed(job, pods, nodes=seen, model=LLAMA_8B, progress=at, link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert [a.name for a in stale.actions if isinstance(a, DeletePod)] == ["j-stage-0"]
    assert stale.status is not None and [s.restarts for s in stale.status.stages] == [0, 0]
    assert stale.status.plan_epoch == 1  # the same plan: no new epoch


def test_a_job_of_one_pipeline_does_not_grow_where_the_restart_costs_more_than_it_saves() -> None:
    start = [n for n in NODES if n["metadata"]["name"] == "h100-0"]
    job, pods, files = training(BIG, start)
    # Near its end: what the added pipeline would save does not pay for the restart.
    late = Progress(status={"step": STEPS - 30, "totalSteps": STEPS,
                            "lastCommittedStep": STEPS - 60}, done=False, output=None)  # fmt: skip
    kept = decide(
        observed(job, pods, nodes=[*start, h100(1)], model=LLAMA_8B, progress=late,
                 link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert not [a for a in kept.actions if isinstance(a, Create | DeletePod)]
    assert kept.status is not None and kept.status.growth is not None  # says why
    # A fixed count of one is what the user asked for.
    fixed = copy.deepcopy(job)
    fixed["spec"]["pipeline"]["replicas"] = 1
    assert not needs(fixed, stage_pods(pods), NOW).room


def test_a_pipeline_whose_replacement_waits_as_long_as_a_resplit_costs_leaves_and_moves() -> None:
    job, pods, files = training()
    # Pipeline 2's A100 node is gone; its stage's replacement (restart 1) was created on
    # the full A100 pool and waits there. An H100 joins once the pipeline has left.
    waiting, others, gone = replacement_waiting(job, pods, 2, "a100")
    before = [n for n in NODES if n["metadata"]["name"] != gone]
    cost = SETTINGS.join_seconds

    def after(
        waited: float, now_pods: list[dict[str, Any]], of: Any = None, seen: Any = before
    ) -> Decision:
        return decide(
            observed(of or job, aged(now_pods, "j-p2-s0", waited), nodes=seen, model=LLAMA_8B,
                     progress=progress(40), link_secret=secret(files)),
            SETTINGS,
        )  # fmt: skip

    # Before it waited as long as a re-split costs: it waits on, and the pass is due again.
    early = after(cost - 30, [*others, waiting])
    assert not [a for a in early.actions if isinstance(a, DeletePod)]
    assert early.retry_after is not None and early.retry_after <= 30
    # Were an H100 to join while the replacement waited, the replacement would move
    # to it at once, the pipeline training on (create.rehome_waiting).
    moved = after(cost - 30, [*others, waiting], seen=[*before, h100(1)])
    assert [a.name for a in moved.actions if isinstance(a, DeletePod)] == ["j-p2-s0"]
    assert moved.status is not None and moved.status.pipelines is not None
    assert moved.status.pipelines[2].phase != "Left"
    assert [a.reason for a in moved.actions if isinstance(a, PostEvent)] == ["StageMoving"]
    # ... and so it would after as long as a re-split costs: a move restarts one stage, the
    # pipeline leaving restarts all of them.
    moved = after(cost + 5, [*others, waiting], seen=[*before, h100(1)])
    assert [a.reason for a in moved.actions if isinstance(a, PostEvent)] == ["StageMoving"]
    # Then the pipeline leaves: its pod goes, no failure is counted, an Event says why.
    late = after(cost + 5, [*others, waiting])
    assert [a.name for a in late.actions if isinstance(a, DeletePod)] == ["j-p2-s0"]
    assert late.status is not None and late.status.pipelines is not None
    left = late.status.pipelines[2]
    assert left.phase == "Left" and left.left_reason is not None
    assert f"the replacement of its stage 0 waited {int(cost) + 5} s for a GPU" in (
        left.left_reason
    )
    assert [s.restarts for s in late.status.stages if s.pipeline == 2] == [1]
    (said,) = [
        a for a in late.actions if isinstance(a, PostEvent) and a.reason == "PipelineLeaving"
    ]
    assert said.message.startswith("Pipeline 2 leaves at step 40: the replacement of its stage 0")
    # Its pod gone, it comes back where its stage fits: the H100 that joined.
    job["status"] = to_manifest(late.status)
    back = after(0, others, seen=[*before, h100(1)])
    created = [a.obj for a in back.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p2-s0"]
    assert created[0]["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    # A job whose stages could not be told of a pipeline added in its place (a store not on
    # s3://) waits on its pool.
    local = copy.deepcopy(job)
    local["status"]["pipelines"][2].update(phase="Recovering", leftReason=None)
    local["spec"]["checkpoint"] = {"uri": "/checkpoints"}
    kept = after(cost + 5, [*others, waiting], local)
    assert not [a for a in kept.actions if isinstance(a, DeletePod)]


def test_a_fixed_count_keeps_its_pipelines_by_one_shaped_for_the_gpus_free() -> None:
    # `replicas: 2` on four RTX 4090s: two pipelines of two stages. Pipeline 1's two nodes
    # go; its replacements wait on the full pool, and an H100 joins, which holds the whole
    # model in one stage.
    rtx = [node(f"rtx-{i}", "rtx") for i in range(4)]
    fixed = BIG.pipeline(stages="auto", replicas=2)
    job, pods, files = training(fixed, rtx)
    plan = job["status"]["plan"]["pipelines"]
    assert [[s["pool"] for s in p["stages"]] for p in plan] == [["rtx", "rtx"], ["rtx", "rtx"]]
    lost = {p["spec"]["nodeName"] for p in pods if p["metadata"]["name"].startswith("j-p1-")}
    seen = [n for n in rtx if n["metadata"]["name"] not in lost] + [h100(1)]
    others = [p for p in pods if not p["metadata"]["name"].startswith("j-p1-")]
    waiting = []
    for p in pods:
        if p["metadata"]["name"].startswith("j-p1-"):
            w = copy.deepcopy(p)
            w["metadata"]["annotations"][WAITING_ANNOTATION] = "waits for a GPU on pool rtx"
            w["metadata"]["annotations"]["relaytrain.io/incarnation"] = "1"
            w["metadata"]["uid"] += "-1"
            w["metadata"]["creationTimestamp"] = (
                (NOW - timedelta(seconds=SETTINGS.join_seconds + 5)).isoformat()
            ).replace("+00:00", "Z")
            w["spec"]["nodeName"] = None
            w["status"] = {"phase": "Pending"}
            waiting.append(w)
    for entry in job["status"]["stages"]:
        if entry.get("pipeline") == 1:
            entry.update(restarts=1, phase="Pending", ready=False, node=None)
    job["status"]["pipelines"][1]["phase"] = "Recovering"

    def decided(now_pods: list[dict[str, Any]]) -> Decision:
        return decide(
            observed(job, now_pods, nodes=seen, model=LLAMA_8B, progress=progress(40),
                     link_secret=secret(files)),
            SETTINGS,
        )  # fmt: skip

    # It waited as long as a re-split costs: pipeline 1 leaves.
    left = decided([*others, *waiting])
    assert sorted(a.name for a in left.actions if isinstance(a, DeletePod)) == [
        "j-p1-s0",
        "j-p1-s1",
    ]
    assert left.status is not None and left.status.pipelines is not None
    assert left.status.pipelines[1].phase == "Left"
    # Its pods gone, its two stages fit nowhere (one GPU free): a pipeline of one stage on
    # the H100 takes its place, under a new index; the count stays two.
    job["status"] = to_manifest(left.status)
    grown = decided(others)
    created = [a.obj for a in grown.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in created] == ["j-p2-s0"]
    assert created[0]["spec"]["nodeSelector"]["relaytrain.io/pool"] == "h100"
    assert grown.status is not None and grown.status.pipelines is not None
    assert [p.phase for p in grown.status.pipelines] == ["Running", "Left", "Pending"]
    # With two training, pipeline 1 does not come back when its GPUs do, nor is another
    # added: the job trains the two the user asked for.
    job["status"] = to_manifest(grown.status)
    running = [*others, *run_pods_of(grown, "h100-1")]
    full = decide(
        observed(job, running, nodes=[*rtx, h100(1), h100(2)], model=LLAMA_8B,
                 progress=progress(40), link_secret=secret(files)),
        SETTINGS,
    )  # fmt: skip
    assert not [a for a in full.actions if isinstance(a, Create) and a.obj["kind"] == "Pod"]
