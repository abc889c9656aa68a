"""Real text that stays put, for a real model's benchmarks and tests: the long descriptions
(READMEs and changelogs) in the installed metadata of dependencies whose versions uv.lock
pins. A run's rows do not move when this repository's docs do, as they did while the
SmolLM2 test and `bench/bench_boundary_spectrum.py` read docs/*.md."""

from __future__ import annotations

from importlib import metadata

PACKAGES = ("accelerate", "huggingface-hub", "peft", "pydantic", "regex", "tokenizers", "torch",
            "tqdm", "transformers")  # fmt: skip
"""The packages whose descriptions `prose` reads (every one pinned by uv.lock)."""


def prose() -> str:
    """English prose and code: the long descriptions of ``PACKAGES``, in that order (each
    package's metadata body, as PEP 566's JSON form names it)."""
    return "\n".join(_description(name) for name in PACKAGES)


def _description(name: str) -> str:
    text = metadata.metadata(name).json.get("description", "")
    return text if isinstance(text, str) else "\n".join(text)
