"""The pure builders: what a stage pod, the Service and the link Secret look like."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest
from relaytrain_contract import CONFIG_ENV
from relaytrain_operator.domain.builders.labels import JOB_LABEL, STAGE_LABEL, stage_dns_name
from relaytrain_operator.domain.builders.secret import build_link_secret
from relaytrain_operator.domain.builders.service import build_service
from relaytrain_operator.domain.linkcerts import mint_link_credentials
from relaytrain_testkit.stage_pods import JOB, pod_for

pytestmark = pytest.mark.unit


def test_stage_pod_has_a_stable_dns_name_under_the_job_service() -> None:
    pod = pod_for(1)
    assert pod["metadata"]["name"] == "smol-stage-1"
    assert pod["spec"]["hostname"] == "smol-stage-1"
    assert pod["spec"]["subdomain"] == "smol"
    assert pod["metadata"]["labels"][JOB_LABEL] == "smol"
    assert pod["metadata"]["labels"][STAGE_LABEL] == "1"
    assert stage_dns_name("smol", "team-a", 1) == "smol-stage-1.smol.team-a.svc"
    # The service selects exactly the job's pods by the label every stage pod carries.
    service = build_service(JOB.build())
    assert service["spec"]["selector"] == {JOB_LABEL: "smol"}
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == pod["spec"]["subdomain"]


def test_stage_pod_is_pinned_and_requests_one_gpu_and_the_planned_memory_and_the_runtime() -> None:
    pod = pod_for(0)
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    resources = spec["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "1"
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    # The plan's 3 GiB + 1 byte rounded up, never under it, and 2 GiB for Python and torch.
    assert resources["requests"]["memory"] == "5121Mi"
    assert resources["limits"]["memory"] == "5121Mi"
    assert spec["restartPolicy"] == "Never"


def test_stage_pod_is_locked_down() -> None:
    spec = pod_for(0)["spec"]
    container = spec["containers"][0]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    ctx = container["securityContext"]
    assert ctx == {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_secrets_reach_the_pod_only_by_reference() -> None:
    pod = pod_for(0)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    config = json.loads(env["RELAYTRAIN_STAGE_CONFIG"]["value"])
    assert config["stage"]["index"] == 0 and config["stage"]["layerEnd"] == 20
    for name, (secret, key) in {
        "AWS_ACCESS_KEY_ID": ("s3-creds", "id"),
        "AWS_SECRET_ACCESS_KEY": ("s3-creds", "key"),
    }.items():
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": key}
    # No literal value anywhere in the pod looks like a credential.
    assert "s3-creds" not in env["RELAYTRAIN_STAGE_CONFIG"]["value"]
    assert "PRIVATE KEY" not in json.dumps(pod)


def test_each_stage_pod_mounts_only_its_own_link_key_where_its_document_says() -> None:
    pod = pod_for(1)
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "smol-link"
    assert volume["secret"]["defaultMode"] == 0o440  # the worker's group reads it, no one else
    assert pod["spec"]["securityContext"]["fsGroup"] == 10001
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {
        "ca.crt": "ca.crt",
        "p0-s1.crt": "tls.crt",
        "p0-s1.key": "tls.key",
    }
    container = pod["spec"]["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    document = json.loads(next(e["value"] for e in container["env"] if e["name"] == CONFIG_ENV))
    assert mount == {
        "name": volume["name"],
        "mountPath": document["links"]["credentialsDir"],
        "readOnly": True,
    }
    assert not [e for e in container["env"] if "LINK" in e["name"]]


def test_every_child_is_owned_by_the_job() -> None:
    files = mint_link_credentials("team-a", "smol", [2], now=datetime.now(UTC))
    secret = build_link_secret(JOB.build(), files, {})
    for child in (pod_for(0), build_service(JOB.build()), secret):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "relaytrain.io/v1alpha1",
            "kind": "FineTuneJob",
            "name": "smol",
            "uid": "u-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "team-a"
    # The link Secret holds the CA certificate and each stage's certificate and key.
    assert sorted(secret["data"]) == ["ca.crt", "p0-s0.crt", "p0-s0.key", "p0-s1.crt", "p0-s1.key"]
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == files


def test_tolerations_priority_and_runtime_class_are_copied() -> None:
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    pod = pod_for(
        0, tolerations=[toleration], priority_class_name="training", runtime_class_name="nvidia"
    )
    assert pod["spec"]["tolerations"] == [toleration]
    assert pod["spec"]["priorityClassName"] == "training"
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    assert "tolerations" not in pod_for(0)["spec"]
    assert "runtimeClassName" not in pod_for(0)["spec"]


def test_builders_are_pure() -> None:
    assert pod_for(1) == pod_for(1)
    assert build_service(JOB.build()) == build_service(JOB.build())
