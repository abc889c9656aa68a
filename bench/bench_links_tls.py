"""What mutual TLS costs on the links: the TLS links against the PSK + AES-GCM links they
replaced, side by side over loopback.

    .venv/bin/python bench/bench_links_tls.py [--quick] [--baseline-ref REF] [--json OUT]

The baseline is the transport of git ref REF (default: the last commit with the PSK links),
loaded from `git show` into a temporary package, so both run in this process on the same
machine, interleaved round by round (best of N each: the machine is shared). Measured:
1. Bulk, one direction: MB/s of fp32 tensor data in 16 MiB frames (`none`), a sender and
   a receiver thread, and wire bytes per tensor byte.
2. Both directions at once (1F1B sends activations down while gradients come up): MB/s
   summed over the two directions, 4 MiB frames.
3. Small frames: frames/s of empty control frames streamed one way, and the round trip of
   one (ping-pong), in microseconds.
4. Link set-up: connect + accept (the handshake) in milliseconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO),
    str(REPO / "operator"),
    str(REPO / "worker_image"),
    str(REPO / "testkit"),
]

from relaytrain_testkit.linkcreds import stage_credentials  # noqa: E402
from relaytrain_worker.pipeline import transport as tls_transport  # noqa: E402

PSK_REF = "b2c5210"
"""The last commit whose links use the pre-shared key and the hand-written record layer."""


def load_baseline(ref: str) -> ModuleType | None:
    """The transport of `ref` (with its own linkauth) as a fresh module; None (and a note)
    when this checkout does not have `ref` (a shallow clone)."""
    root = Path(tempfile.mkdtemp(prefix="bench-links-"))
    pkg = root / "psk_links"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("linkauth", "transport"):
        shown = subprocess.run(
            ["git", "show", f"{ref}:worker_image/relaytrain_worker/{name}.py"],
            cwd=REPO, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if shown.returncode != 0:
            print(f"No baseline: {shown.stderr.strip()}; measuring the TLS links alone.",
                  file=sys.stderr)  # fmt: skip
            return None
        source = shown.stdout
        source = source.replace("from relaytrain_worker.linkauth", "from psk_links.linkauth")
        (pkg / f"{name}.py").write_text(source)
    sys.path.insert(0, str(root))
    return importlib.import_module("psk_links.transport")


def psk_pair(mod: ModuleType) -> tuple[Any, Any]:
    secret = b"s" * 32
    lst = mod.listen("127.0.0.1:0", secret=secret, job_id="bench", stage=1)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("down", lst.accept(timeout=30)))
    t.start()
    up = mod.connect(f"127.0.0.1:{lst.address[1]}", secret=secret, job_id="bench", stage=0)
    t.join()
    lst.close()
    return up, out["down"]


CREDS = stage_credentials(2, job="bench")


def tls_pair(mod: ModuleType) -> tuple[Any, Any]:
    lst = mod.listen("127.0.0.1:0", credentials=CREDS[1], expect=CREDS[0].identity)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("down", lst.accept(timeout=30)))
    t.start()
    up = mod.connect(f"127.0.0.1:{lst.address[1]}", credentials=CREDS[0], expect=CREDS[1].identity)
    t.join()
    lst.close()
    return up, out["down"]


def _stream(src: Any, dst: Any, frame: Any, frames: int) -> float:
    """Seconds to move `frames` copies of `frame` from src to dst (receiver on a thread)."""
    t = threading.Thread(target=lambda: [dst.recv(timeout=120) for _ in range(frames)])
    start = time.perf_counter()
    t.start()
    for _ in range(frames):
        src.send(frame)
    t.join()
    return time.perf_counter() - start


def bulk(mod: ModuleType, up: Any, down: Any, values: int, frames: int) -> dict[str, float]:
    frame = mod.Frame("activation", 0, 0, {"h": torch.randn(values)})
    wire0 = up.bytes_sent
    secs = _stream(up, down, frame, frames)
    data = values * 4 * frames
    return {"MBps": data / secs / 1e6, "wire_per_byte": (up.bytes_sent - wire0) / data}


def duplex(mod: ModuleType, up: Any, down: Any, values: int, frames: int) -> dict[str, float]:
    fwd = mod.Frame("activation", 0, 0, {"h": torch.randn(values)})
    bwd = mod.Frame("gradient", 0, 0, {"g": torch.randn(values)})
    t = threading.Thread(target=lambda: _stream(down, up, bwd, frames))
    start = time.perf_counter()
    t.start()
    _stream(up, down, fwd, frames)
    t.join()
    secs = time.perf_counter() - start
    return {"MBps": 2 * values * 4 * frames / secs / 1e6}


def small(mod: ModuleType, up: Any, down: Any, frames: int) -> dict[str, float]:
    frame = mod.Frame("control", 0, -1, meta={"resume": 12})
    secs = _stream(up, down, frame, frames)
    rtts = []
    for _ in range(200):
        start = time.perf_counter()
        up.send(frame)
        down.recv(timeout=30)
        down.send(frame)
        up.recv(timeout=30)
        rtts.append(time.perf_counter() - start)
    rtts.sort()
    return {"frames_per_s": frames / secs, "rtt_us": rtts[len(rtts) // 2] * 1e6}


def setup_ms(make_pair: Callable[[], tuple[Any, Any]]) -> float:
    start = time.perf_counter()
    up, down = make_pair()
    secs = time.perf_counter() - start
    up.close()
    down.close()
    return secs * 1e3


def measure(
    name: str, mod: ModuleType, pair: Callable[[ModuleType], tuple[Any, Any]], quick: bool
) -> dict[str, float]:
    big = (1 << 20) if quick else (4 << 20)  # fp32 values: 4 / 16 MiB frames
    up, down = pair(mod)
    try:
        _stream(up, down, mod.Frame("activation", 0, 0, {"h": torch.randn(big)}), 2)  # warm-up
        one_way = bulk(mod, up, down, big, 4 if quick else 8)
        both = duplex(mod, up, down, big // 4, 4 if quick else 8)
        tiny = small(mod, up, down, 2000 if quick else 10000)
    finally:
        up.close()
        down.close()
    return {
        "bulk_MBps": one_way["MBps"],
        "wire_bytes_per_tensor_byte": one_way["wire_per_byte"],
        "duplex_MBps": both["MBps"],
        "small_frames_per_s": tiny["frames_per_s"],
        "small_rtt_us": tiny["rtt_us"],
        "setup_ms": setup_ms(lambda: pair(mod)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller frames, fewer rounds")
    parser.add_argument("--baseline-ref", default=PSK_REF, help=f"git ref (default {PSK_REF})")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per variant (best of)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    torch.manual_seed(0)
    variants: dict[str, tuple[ModuleType, Callable[[ModuleType], tuple[Any, Any]]]] = {}
    baseline = load_baseline(args.baseline_ref)
    if baseline is not None:
        variants[f"psk ({args.baseline_ref})"] = (baseline, psk_pair)
    variants["tls"] = (tls_transport, tls_pair)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleaved, so drift in the machine's load hits both
        for name, (mod, pair) in variants.items():
            samples[name].append(measure(name, mod, pair, args.quick))
    lower_is_better = {"small_rtt_us", "setup_ms", "wire_bytes_per_tensor_byte"}
    best = {
        name: {
            key: (min if key in lower_is_better else max)(s[key] for s in runs) for key in runs[0]
        }
        for name, runs in samples.items()
    }
    if baseline is not None:
        old, new = best.values()
        best["tls / psk"] = {key: new[key] / old[key] for key in new}
    print(json.dumps(best, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"best": best, "samples": samples}, indent=2))


if __name__ == "__main__":
    main()
