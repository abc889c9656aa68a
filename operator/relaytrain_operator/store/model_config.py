"""Where `relaytrain plan` finds the model's architecture: its Hugging Face config.json.

The planner needs the model's shape (layers, widths, vocabulary), which config.json
holds. The sources, tried in this order; the first that answers wins:

1. ``--model-config FILE``: that file (an error when it cannot be read; no fallback).
2. ``spec.model.uri``, when it can be read from this machine:

   * a local directory (its ``config.json``) or a config.json file, ``file://`` too;
   * ``s3://bucket/prefix/``: ``<prefix>/config.json``, through the minio client. The
     endpoint is ``spec.checkpoint.endpoint`` (a job's s3:// URIs share it), else
     ``$AWS_ENDPOINT_URL_S3``, else ``$AWS_ENDPOINT_URL``, else AWS S3; the keys are
     ``$AWS_ACCESS_KEY_ID`` and ``$AWS_SECRET_ACCESS_KEY`` (anonymous without them). One
     attempt: 2 s to connect, 5 s to read, at most 10 s in all, name resolution included;
   * ``hf://org/name``: the huggingface_hub cache on disk, never the network:
     ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
     ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``; in it
     ``models--org--name/snapshots/<refs/main>/config.json`` (a lone snapshot serves when
     ``refs/main`` is missing).

3. A config.json shipped with relaytrain (``relaytrain_operator/known_models/<name>.json``,
   public facts copied from the model's hub page) for the model the URI names: the URI's
   last path component, lower-cased, equals ``<name>`` (``s3://models/llama-3.1-8b/``,
   ``hf://meta-llama/Llama-3.1-8B`` and ``/data/Llama-3.1-8B`` all name ``llama-3.1-8b``;
   a trailing ``config.json`` is skipped).

A source that is absent or unreachable hands on to the next, and the result remembers why
(`Resolved.skipped`). A config that is found but is not a JSON object is an error, not a
reason to guess. When nothing answers, `ModelConfigError` names every source tried, why
each failed, and the options. Never imports torch or transformers (the operator must not).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

from relaytrain_contract import ACCESS_KEY_ENV, SECRET_KEY_ENV

JsonDict = dict[str, Any]
Source = Literal["model-config", "uri", "hf-cache", "shipped"]

#: Longest wait for an s3:// read, name resolution included.
S3_DEADLINE_SECONDS = 10.0

_T = TypeVar("_T")


class ModelConfigError(Exception):
    """No usable config.json; the message says what was tried and what to do."""


class _NotHereError(Exception):
    """This source does not have the config (absent, unreachable); the message says why."""


@dataclass(frozen=True)
class Resolved:
    """A model's config.json and where it came from."""

    config: JsonDict
    """The config.json contents."""
    source: Source
    """Which kind of source answered."""
    location: str
    """What was read: a file, an s3:// object, or the shipped name."""
    uri: str
    """The job's spec.model.uri."""
    skipped: tuple[str, ...] = ()
    """Sources tried before this one, each with why it did not answer."""

    def describe(self) -> str:
        """One line a person reads: what and from where."""
        if self.source == "model-config":
            return f"{self.location} (--model-config)"
        if self.source == "uri":
            return f"{self.location} (spec.model.uri)"
        if self.source == "hf-cache":
            return f"{self.location} (huggingface_hub cache for {self.uri})"
        return f"{self.location} (shipped config for {self.uri})"

    def to_dict(self) -> JsonDict:
        """For `relaytrain plan --json`."""
        return {
            "uri": self.uri,
            "source": self.source,
            "location": self.location,
            "description": self.describe(),
            "skipped": list(self.skipped),
        }


def shipped_names() -> list[str]:
    """Names of the model configs shipped with relaytrain, sorted."""
    folder = resources.files("relaytrain_operator").joinpath("known_models")
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def shipped_config(name: str) -> JsonDict:
    """The shipped config.json called `name` (see `shipped_names`)."""
    path = resources.files("relaytrain_operator").joinpath("known_models", f"{name}.json")
    value: JsonDict = json.loads(path.read_text())
    return value


def named_model(uri: str) -> str:
    """The name a URI gives its model: its last path component, lower-cased."""
    parts = [p for p in uri.split("://", 1)[-1].split("/") if p]
    if parts and parts[-1] == "config.json":
        parts.pop()
    return parts[-1].lower() if parts else ""


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The huggingface_hub cache folder, as huggingface_hub itself finds it."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(key):
            return Path(environ[key]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    cache = environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "huggingface" / "hub"


def resolve(
    uri: str,
    *,
    model_config: Path | None = None,
    endpoint: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Resolved:
    """The model's config.json from the first source that has it (see the module doc).

    `endpoint` is the job's S3 endpoint (spec.checkpoint.endpoint). Raises
    ModelConfigError when no source answers or a found config is not a JSON object.
    """
    env = os.environ if environ is None else environ
    if model_config is not None:
        config = _read_file(model_config, "--model-config")
        return Resolved(config, "model-config", str(model_config), uri)
    tried: list[str] = []
    attempts: list[tuple[Source, Callable[[], tuple[JsonDict, str]]]] = []
    if uri.startswith("s3://"):
        attempts.append(("uri", lambda: _from_s3(uri, endpoint, env)))
    elif uri.startswith("hf://"):
        attempts.append(("hf-cache", lambda: _from_hub_cache(uri, env)))
    else:
        attempts.append(("uri", lambda: _from_local(uri)))
    attempts.append(("shipped", lambda: _from_shipped(uri)))
    for source, attempt in attempts:
        try:
            config, location = attempt()
        except _NotHereError as why:
            tried.append(str(why))
            continue
        return Resolved(config, source, location, uri, tuple(tried))
    raise ModelConfigError(_nothing_found(uri, tried))


def _nothing_found(uri: str, tried: list[str]) -> str:
    lines = [f"cannot find the architecture (config.json) of spec.model.uri {uri!r}:"]
    lines += [f"  - {why}" for why in tried]
    lines.append(
        "Pass --model-config with the model's config.json; or make the URI readable from "
        "here (a local directory; s3:// with spec.checkpoint.endpoint or $AWS_ENDPOINT_URL "
        "and $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY; hf:// in the huggingface_hub cache); "
        "or end the URI with a shipped model's name: " + ", ".join(shipped_names()) + "."
    )
    return "\n".join(lines)


def _parse(data: str | bytes, where: str) -> JsonDict:
    try:
        value = json.loads(data)
    except ValueError as err:
        raise ModelConfigError(f"model config {where} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"model config {where} is not a JSON object")
    return value


def _read_file(path: Path, what: str) -> JsonDict:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelConfigError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None
    return _parse(data, repr(str(path)))


def _from_local(uri: str) -> tuple[JsonDict, str]:
    path = Path(uri.removeprefix("file://")).expanduser()
    if not path.exists():
        raise _NotHereError(f"local path {str(path)!r}: does not exist")
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise _NotHereError(f"local path {str(path)!r}: has no config.json")
    try:
        data = config.read_bytes()
    except OSError as err:
        raise _NotHereError(f"local path {str(config)!r}: {err.strerror}") from None
    return _parse(data, repr(str(config))), str(config)


def _from_s3(uri: str, endpoint: str | None, env: Mapping[str, str]) -> tuple[JsonDict, str]:
    endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    where = endpoint or "AWS S3"
    key = uri.rstrip("/") + "/config.json"
    try:
        # The minio client comes with the operator extra; `relaytrain plan` runs without it.
        from minio.error import MinioException

        from relaytrain_operator.store.objectstore import StoreAccess, StoreError, read_json
    except ImportError:
        raise _NotHereError(
            f"{key}: the minio client is not installed (relaytrain[operator])"
        ) from None
    access = StoreAccess(endpoint, env.get(ACCESS_KEY_ENV) or None, env.get(SECRET_KEY_ENV) or None)
    try:
        config = _within(S3_DEADLINE_SECONDS, lambda: read_json(uri, "config.json", access))
    except StoreError as err:
        raise _NotHereError(f"{key} at {where}: {_short(err)}") from None
    except MinioException as err:  # an answer, but not S3's (e.g. some other web server)
        raise _NotHereError(f"{key} at {where}: {err}") from None
    except TimeoutError:
        raise _NotHereError(f"{key} at {where}: no answer in {S3_DEADLINE_SECONDS:g} s") from None
    if config is None:
        raise _NotHereError(f"{key} at {where}: no such object")
    return config, key


def _short(err: Exception) -> str:
    """Why an S3 read failed, without urllib3's wrapping or our own prefix."""
    reason = getattr(err.__cause__, "reason", None)  # urllib3's MaxRetryError
    if reason is not None:
        return re.sub(r"^\w+\([^)]*\):\s*", "", str(reason)) or type(reason).__name__
    return str(err).split(": ", 1)[-1]  # StoreError: "reading config.json under URI: why"


def _within(seconds: float, call: Callable[[], _T]) -> _T:
    """`call()`, or TimeoutError after `seconds` (the call is left to finish alone)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # handed to the caller below
            box["error"] = err

    thread = threading.Thread(target=target, name="model-config-read", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    result: _T = box["value"]
    return result


def _from_hub_cache(uri: str, env: Mapping[str, str]) -> tuple[JsonDict, str]:
    repo_id = uri.removeprefix("hf://").strip("/")
    cache = hub_cache_dir(env)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    where = f"huggingface_hub cache {str(cache)!r}"
    if not repo.is_dir():
        raise _NotHereError(f"{where}: no {repo.name}")
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
    else:
        found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
        if len(found) != 1:
            raise _NotHereError(
                f"{where}: {repo.name} has no refs/main and {len(found)} snapshots; "
                "pass --model-config with one of them"
            )
        snapshot = found[0]
    config = snapshot / "config.json"
    if not config.is_file():
        raise _NotHereError(f"{where}: {repo.name} snapshot {snapshot.name} has no config.json")
    return _parse(config.read_bytes(), repr(str(config))), str(config)


def _from_shipped(uri: str) -> tuple[JsonDict, str]:
    name = named_model(uri)
    names = shipped_names()
    if name not in names:
        raise _NotHereError(
            f"shipped configs: none is named {name!r} (shipped: {', '.join(names)})"
        )
    return shipped_config(name), name
