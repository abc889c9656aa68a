"""The audit-log reader behind the chart's RBAC check (tests/rbac_audit.py): what counts as
a use, what as a refusal, and what a rendered Role grants."""

from __future__ import annotations

import json
from typing import Any

import pytest
from relaytrain_testkit.harness.rbac_audit import (
    Permission,
    calls_of,
    granted_to,
    service_account_user,
)

pytestmark = pytest.mark.unit

USER = service_account_user("ops", "rt-relaytrain")
FORBID = {"annotations": {"authorization.k8s.io/decision": "forbid"}}
PLURALS = {("relaytrain.io", "FineTuneJob"): "finetunejobs"}


def event(verb: str, resource: str, code: int = 200, **extra: Any) -> str:
    ref: dict[str, Any] = {
        "resource": resource.partition("/")[0],
        "apiGroup": extra.pop("group", ""),
    }
    if "/" in resource:
        ref["subresource"] = resource.partition("/")[2]
    return json.dumps(
        {
            "stage": extra.pop("stage", "ResponseComplete"),
            "user": {"username": extra.pop("user", USER)},
            "verb": verb,
            "objectRef": ref,
            "requestURI": f"/x/{resource}",
            "responseStatus": {"code": code},
            **extra,
        }
    )


def test_uses_refusals_and_other_users_are_told_apart() -> None:
    log = "\n".join(
        [
            event("list", "pods"),
            event("patch", "finetunejobs/status", group="relaytrain.io"),
            event("delete", "secrets", code=403, **FORBID),
            event("create", "events", code=403),  # refused by admission: authorized, used
            event("create", "services", code=409),  # exists: allowed, still a use
            event("delete", "nodes", user="system:serviceaccount:ops:other"),
            event("get", "pods", stage="ResponseStarted"),
            json.dumps(
                {
                    "stage": "ResponseComplete",
                    "user": {"username": USER},
                    "verb": "get",
                    "requestURI": "/apis",
                    "responseStatus": {"code": 200},
                }
            ),
        ]
    )
    calls = calls_of(log, USER, PLURALS)
    assert calls.used == {
        Permission("", "pods", "list"),
        Permission("relaytrain.io", "finetunejobs/status", "patch"),
        Permission("", "services", "create"),
        Permission("", "events", "create"),
    }
    assert [r.permission for r in calls.refused] == [Permission("", "secrets", "delete")]


def test_a_blocking_owner_reference_uses_the_owners_finalizers() -> None:
    owner = {"apiVersion": "relaytrain.io/v1alpha1", "kind": "FineTuneJob", "name": "j"}
    body = {"metadata": {"ownerReferences": [{**owner, "blockOwnerDeletion": True}]}}
    calls = calls_of(event("create", "pods", requestObject=body), USER, PLURALS)
    assert Permission("relaytrain.io", "finetunejobs/finalizers", "update") in calls.used
    plain = {"metadata": {"ownerReferences": [owner]}}
    calls = calls_of(event("create", "pods", requestObject=plain), USER, PLURALS)
    assert calls.used == {Permission("", "pods", "create")}


def _rbac(rules: list[dict[str, Any]], account: str = "rt-relaytrain") -> list[dict[str, Any]]:
    return [
        {"kind": "ClusterRole", "metadata": {"name": "r"}, "rules": rules},
        {
            "kind": "ClusterRole",
            "metadata": {"name": "unbound"},
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["delete"]}],
        },
        {
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "b"},
            "roleRef": {"kind": "ClusterRole", "name": "r"},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": "ops"}],
        },
    ]


def test_grants_expand_every_group_resource_and_verb_of_bound_roles_only() -> None:
    rule = {
        "apiGroups": ["", "events.k8s.io"],
        "resources": ["events"],
        "verbs": ["create", "patch"],
    }
    assert granted_to(_rbac([rule]), "ops", "rt-relaytrain") == {
        Permission(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")
    }
    assert granted_to(_rbac([rule], account="someone-else"), "ops", "rt-relaytrain") == set()


def test_a_wildcard_grant_is_refused() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        granted_to(
            _rbac([{"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}]),
            "ops",
            "rt-relaytrain",
        )


def test_a_last_line_still_being_written_is_left_for_later_and_a_broken_one_is_not() -> None:
    whole = event("list", "pods") + "\n" + event("get", "secrets") + "\n"
    half = event("delete", "nodes")[:60]
    assert calls_of(whole + half, USER, PLURALS).used == {
        Permission("", "pods", "list"),
        Permission("", "secrets", "get"),
    }
    with pytest.raises(json.JSONDecodeError):
        calls_of(half + "\n" + whole, USER, PLURALS)
