"""The per-stage /metrics and /healthz endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from relaytrain_worker.state.metrics import MetricsServer, StageMetrics, serve

pytestmark = pytest.mark.unit


@dataclass
class FakeLink:
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes_sent: int = 0
    payload_bytes_sent: int = 0


@pytest.fixture
def served() -> Iterator[tuple[StageMetrics, MetricsServer]]:
    metrics = StageMetrics("default/smollm-lora", 1)
    server = serve(metrics, port=0, host="127.0.0.1")
    yield metrics, server
    server.stop()


def _get(server: MetricsServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    want = {"job": "default/smollm-lora", "stage": "1", **labels}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(kv.split("=", 1) for kv in line[len(name) + 1 : line.index("}")].split(","))
            if {k: v.strip('"') for k, v in got.items()} == want:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{want} not in /metrics")


def test_metrics_report_training_links_and_checkpoints(
    served: tuple[StageMetrics, MetricsServer],
) -> None:
    metrics, server = served
    metrics.step.set(12)
    metrics.loss.set(2.31)
    metrics.tokens_per_second.set(812.5)
    metrics.checkpoint_seconds.observe(1.7)
    metrics.restores.inc()
    link = FakeLink(1000, 200, 4000, 1040)
    metrics.update_link("next", link)
    link.bytes_sent, link.bytes_received = 1500, 260
    metrics.update_link("next", link)
    metrics.update_link("next", FakeLink(100, 0))  # a new link after a reconnect adds on

    status, text = _get(server, "/metrics")
    assert status == 200
    assert _value(text, "relaytrain_step") == 12
    assert _value(text, "relaytrain_loss") == 2.31
    assert _value(text, "relaytrain_tokens_per_second") == 812.5
    assert _value(text, "relaytrain_link_sent_bytes_total", link="next") == 1600
    assert _value(text, "relaytrain_link_received_bytes_total", link="next") == 260
    assert _value(text, "relaytrain_compression_ratio", link="next") == 0.26
    assert _value(text, "relaytrain_checkpoint_save_seconds_count") == 1
    assert _value(text, "relaytrain_checkpoint_save_seconds_sum") == 1.7
    assert _value(text, "relaytrain_restores_total") == 1


def test_healthz_is_503_while_broken_or_recovering(
    served: tuple[StageMetrics, MetricsServer],
) -> None:
    metrics, server = served
    metrics.set_health("training", step=3)
    status, body = _get(server, "/healthz")
    assert status == 200
    assert json.loads(body) == {
        "state": "training", "job": "default/smollm-lora", "stage": "1", "step": 3,
    }  # fmt: skip
    metrics.set_health("recovering", reason="link to stage 2 broke")
    status, body = _get(server, "/healthz")
    assert status == 503 and json.loads(body)["reason"] == "link to stage 2 broke"
    assert _value(_get(server, "/metrics")[1], "relaytrain_healthy") == 0
    assert _get(server, "/nope")[0] == 404
