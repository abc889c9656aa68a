"""A small, deterministic prompt/completion data set for the demo: reverse a list of words.

The base model does this badly and a LoRA adapter learns the pattern in a few dozen steps,
so the loss curve shows learning; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "lamp",
    "green",
    "quiet",
    "north",
    "paper",
    "silver",
    "candle",
    "window",
    "garden",
    "orange",
    "music",
    "winter",
    "yellow",
    "forest",
    "bridge",
    "rocket",
    "pencil",
    "ocean",
    "summer",
    "violet",
    "marble",
    "desert",
    "coffee",
    "planet",
    "shadow",
]


def examples(count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = rng.sample(WORDS, rng.randint(3, 5))
        rows.append(
            {
                "prompt": f"Reverse the words: {' '.join(words)}\nAnswer:",
                "completion": " " + " ".join(reversed(words)),
            }
        )
    return rows


def write(path: Path, count: int = 512, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in examples(count, seed)))
    return path
