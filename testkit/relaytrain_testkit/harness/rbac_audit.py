"""The chart's RBAC, derived from what the operator did.

The local cluster's API server writes an audit log of every ServiceAccount's requests
(hack/audit-policy.yaml). An operator that authenticates as the chart's ServiceAccount
leaves there the exact set of (API group, resource, verb) it used, and every request the
API server refused. Comparing that set with the rules the chart renders finds both kinds
of drift: a grant the code never uses (too broad) and a call the chart does not allow.

One permission is checked by admission, not by a request of its own, so the log cannot
show it as a call: a child whose owner reference sets `blockOwnerDeletion` needs `update`
on its owner's `finalizers` (OwnerReferencesPermissionEnforcement, enabled on the local
API server). The policy logs creations with their bodies, so the owner references the
operator actually wrote are read from the same log.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Permission:
    """One grantable action: `resource` may name a subresource (`finetunejobs/status`)."""

    group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}.{self.group or 'core'}"


@dataclass(frozen=True)
class Refusal:
    """A request authorization refused: the user lacks a grant."""

    permission: Permission
    uri: str


@dataclass
class AuditedCalls:
    """What one user did, read from an audit log."""

    used: set[Permission]
    refused: list[Refusal]


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _events(log: str) -> Iterator[dict[str, Any]]:
    """The log's events. The API server writes the log while it serves, so its last line may
    still be half written: that one is left for a later read; a broken line before it fails."""
    lines = log.splitlines()
    for number, line in enumerate(lines):
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1 and not log.endswith("\n"):
                return
            raise


def calls_of(log: str, user: str, plurals: Mapping[tuple[str, str], str]) -> AuditedCalls:
    """The permissions `user` exercised, by the audit log's text `log` (JSON lines).

    `plurals` maps (group, kind) to the resource name, for owner references (only the
    kinds the operator owns children by need to be there; others raise KeyError, so an
    owner nobody expected fails loudly instead of vanishing).
    """
    used: set[Permission] = set()
    refused: list[Refusal] = []
    for event in _events(log):
        # A watch is logged complete only when it ends (minutes later); its ResponseStarted
        # event says it was authorized and runs.
        stages = (
            ("ResponseComplete", "ResponseStarted")
            if event.get("verb") == "watch"
            else ("ResponseComplete",)
        )
        if event.get("user", {}).get("username") != user or event.get("stage") not in stages:
            continue
        ref = event.get("objectRef")
        if not ref:  # /api, /apis, /version: discovery, granted to every authenticated user
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        permission = Permission(ref.get("apiGroup", ""), resource, event["verb"])
        # Authorization's own verdict; a 403 from admission (say, a namespace being
        # deleted) was authorized, so the grant was used.
        decision = (event.get("annotations") or {}).get("authorization.k8s.io/decision")
        if decision == "forbid":
            refused.append(Refusal(permission, event["requestURI"]))
            continue
        used.add(permission)
        body = event.get("requestObject") or {}
        for owner in (body.get("metadata") or {}).get("ownerReferences") or []:
            if owner.get("blockOwnerDeletion"):
                group = _group(owner["apiVersion"])
                plural = plurals[(group, owner["kind"])]
                used.add(Permission(group, f"{plural}/finalizers", "update"))
    return AuditedCalls(used, refused)


def granted_to(docs: Iterable[dict[str, Any]], namespace: str, account: str) -> set[Permission]:
    """Every permission the rendered RBAC objects give the ServiceAccount.

    Wildcards are refused: a `*` grants what no log can prove necessary.
    """
    docs = list(docs)
    roles = {
        (d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("ClusterRole", "Role")
    }
    granted: set[Permission] = set()
    for binding in docs:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
            continue
        subjects = binding.get("subjects") or []
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == namespace
            for s in subjects
        ):
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role.get("rules") or []:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        if "*" in (group, resource, verb):
                            raise ValueError(f"{role['metadata']['name']} grants a wildcard")
                        granted.add(Permission(group, resource, verb))
    return granted


def explain(unused: set[Permission], missing: set[Permission]) -> str:
    lines = []
    if unused:
        lines.append("The chart grants what the operator never used (remove it):")
        lines += [f"  {p}" for p in sorted(unused)]
    if missing:
        lines.append("The operator used what the chart does not grant:")
        lines += [f"  {p}" for p in sorted(missing)]
    return "\n".join(lines)
