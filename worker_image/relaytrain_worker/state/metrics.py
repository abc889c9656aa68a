"""Per-stage Prometheus metrics and the ``/metrics`` + ``/healthz`` HTTP endpoint.

Each stage owns one ``StageMetrics`` (its own registry, so tests and several stages in one
process do not collide). ``serve`` starts a small threaded HTTP server: ``/metrics`` in the
Prometheus text format, ``/healthz`` as JSON, 200 while the stage is healthy and 503 while
it is broken or recovering (so a readiness probe takes it out of rotation).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from relaytrain_contract import METRICS_PORT

Health = Literal["starting", "ready", "training", "recovering", "broken", "done"]
_UNHEALTHY = ("broken", "recovering")


class LinkCounters(Protocol):
    """What ``update_link`` reads from a transport Link."""

    bytes_sent: int
    bytes_received: int
    raw_bytes_sent: int
    payload_bytes_sent: int


class StageMetrics:
    """The metrics of one stage. Label ``link`` is ``prev`` (towards stage k-1) or ``next``;
    a stage of a job with several pipelines also carries ``pipeline``."""

    def __init__(self, job: str, stage: int, pipeline: int | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = {"job": job, "stage": str(stage)}
        if pipeline is not None:
            labels["pipeline"] = str(pipeline)
        r = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        self._labels = labels
        self.step = gauge("relaytrain_step", "Optimizer steps finished").labels(**labels)
        self.total_steps = gauge("relaytrain_total_steps", "Steps the job runs").labels(**labels)
        self.loss = gauge("relaytrain_loss", "Training loss of the last step").labels(**labels)
        self.eval_loss = gauge(
            "relaytrain_eval_loss", "Held-out loss at the last evaluation (last stage)"
        ).labels(**labels)
        self.eval_step = gauge(
            "relaytrain_eval_step", "Optimizer steps done at the last evaluation"
        ).labels(**labels)
        self.tokens_per_second = gauge(
            "relaytrain_tokens_per_second", "Training tokens per second"
        ).labels(**labels)
        self._data = {
            name: gauge(f"relaytrain_{name}", doc).labels(**labels)
            for name, doc in (
                ("epoch", "Passes over the training rows so far (last stage)"),
                ("examples_seen", "Examples the steps done trained on, every pass counted"),
                ("tokens_seen", "Non-padding input tokens the steps done trained on"),
                ("tokens_trained", "Tokens with a loss the steps done trained on"),
            )
        }
        self._bytes_sent = Counter(
            "relaytrain_link_sent_bytes", "Bytes sent on a link", [*labels, "link"], registry=r
        )
        self._bytes_received = Counter(
            "relaytrain_link_received_bytes",
            "Bytes received on a link",
            [*labels, "link"],
            registry=r,
        )
        self._ratio = gauge(
            "relaytrain_compression_ratio",
            "Sent tensor bytes after compression / before (lower is smaller)",
            ("link",),
        )
        self.checkpoint_seconds = Histogram(
            "relaytrain_checkpoint_save_seconds",
            "Seconds to save this stage's checkpoint",
            [*labels],
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        ).labels(**labels)
        self.restores = Counter(
            "relaytrain_restores", "Times this stage restored a checkpoint", [*labels], registry=r
        ).labels(**labels)
        self.steps_redone = Counter(
            "relaytrain_steps_redone",
            "Steps this stage trained again because a pipeline left in the middle of them",
            [*labels],
            registry=r,
        ).labels(**labels)
        self.last_committed_step = gauge(
            "relaytrain_last_committed_step", "Newest committed checkpoint step"
        ).labels(**labels)
        self._health_gauge = gauge("relaytrain_healthy", "1 if the stage is healthy, else 0")
        self._lock = threading.Lock()
        # Per link name: the link object last seen (kept, so a new one can never be mistaken
        # for it by a reused id()) and its counters then.
        self._seen: dict[str, tuple[LinkCounters, int, int]] = {}
        self._health: Health = "starting"
        self._detail: dict[str, Any] = {}
        self.set_health("starting")

    def update_link(self, name: str, link: LinkCounters) -> None:
        """Add what ``link`` moved since the last call (new links after a reconnect are fine)."""
        sent, received = link.bytes_sent, link.bytes_received
        with self._lock:
            last = self._seen.get(name)
            sent0, recv0 = (last[1], last[2]) if last is not None and last[0] is link else (0, 0)
            self._seen[name] = (link, sent, received)
        self._bytes_sent.labels(**self._labels, link=name).inc(max(0, sent - sent0))
        self._bytes_received.labels(**self._labels, link=name).inc(max(0, received - recv0))
        if link.raw_bytes_sent:
            ratio = link.payload_bytes_sent / link.raw_bytes_sent
            self._ratio.labels(**self._labels, link=name).set(ratio)

    def set_seen(self, epoch: float, examples: int, tokens: int, trained: int) -> None:
        """Where training stands in the data (gauges: a rollback takes them back)."""
        for name, value in zip(self._data, (epoch, examples, tokens, trained), strict=True):
            self._data[name].set(value)

    def set_health(self, state: Health, **detail: Any) -> None:
        """Set what ``/healthz`` reports; ``detail`` (JSON-able) is included in the body."""
        with self._lock:
            self._health = state
            self._detail = dict(detail)
        self._health_gauge.labels(**self._labels).set(0 if state in _UNHEALTHY else 1)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body) of ``/healthz``."""
        with self._lock:
            body = {"state": self._health, **self._labels, **self._detail}
            return (503 if self._health in _UNHEALTHY else 200), body

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """A running ``/metrics`` + ``/healthz`` server; ``port`` is the bound port."""

    def __init__(
        self, metrics: StageMetrics, host: str = "0.0.0.0", port: int = METRICS_PORT
    ) -> None:
        handler = _handler(metrics)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="relaytrain-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(metrics: StageMetrics, port: int = METRICS_PORT, host: str = "0.0.0.0") -> MetricsServer:
    """Start serving ``metrics`` on ``host:port`` (port 0 picks a free one) in a daemon thread."""
    return MetricsServer(metrics, host, port)


def _handler(metrics: StageMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, metrics.exposition(), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                status, body = metrics.health()
                self._reply(status, json.dumps(body).encode(), "application/json")
            else:
                self._reply(404, b"not found\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # scrapes every few seconds would flood the stage's log

    return Handler
