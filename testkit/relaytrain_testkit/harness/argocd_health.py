"""Run the chart's Argo CD health check (charts/relaytrain/files/argocd/health.lua) the way
Argo CD does: a Lua script with the object as the global `obj`, returning a table with
`status` and `message`. The Lua runtime is lupa's (PyPI), so tests run the very script the
chart ships."""

from __future__ import annotations

from typing import Any

from lupa import LuaRuntime

from relaytrain_testkit import REPO

SCRIPT = REPO / "charts" / "relaytrain" / "files" / "argocd" / "health.lua"
STATUSES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")
"""What Argo CD accepts from a health script."""


def health(obj: dict[str, Any], script: str | None = None) -> tuple[str, str]:
    """(status, message) the health script gives for the FineTuneJob `obj`."""
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script if script is not None else SCRIPT.read_text())
    status, message = str(result["status"]), str(result["message"])
    if status not in STATUSES:
        raise ValueError(f"the health script returned {status!r}, not one of {STATUSES}")
    return status, message
