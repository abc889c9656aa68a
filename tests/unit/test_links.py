"""Links between stages over loopback: ordering, authentication, encryption, failures."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from relaytrain_worker.transport import (
    AuthError,
    Frame,
    FrameRejected,
    Link,
    LinkBroken,
    Listener,
    connect,
    listen,
    prepare,
)

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"
JOB = "default/smollm-lora"


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = listen("127.0.0.1:0", secret=SECRET, job_id=JOB, stage=1)
    yield lst
    lst.close()


def _addr(lst: Listener) -> str:
    return f"127.0.0.1:{lst.address[1]}"


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _pair(lst: Listener) -> tuple[Link, Link]:
    """(upstream link of stage 0, downstream link of stage 1)."""
    t, out = _in_thread(lambda: lst.accept(timeout=10))
    up = connect(_addr(lst), secret=SECRET, job_id=JOB, stage=0, retry_for=5)
    t.join(10)
    down = out["value"]
    assert isinstance(down, Link)
    return up, down


def test_frames_arrive_in_order_with_ids_tensors_and_meta(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        assert down.peer_stage == 0 and up.peer_stage == 1
        sent = []
        for step in range(3):
            for micro in range(4):
                h = torch.randn(2, 16, 64)
                labels = torch.randint(0, 1000, (2, 16))
                mask = torch.rand(2, 16) > 0.2
                sent.append((h, labels, mask))
                frame = Frame("activation", step, micro, {"h": h, "labels": labels, "mask": mask})
                frame.meta = {"tokens": 32, "note": "é"}
                up.send(frame, "none")
        for step in range(3):
            for micro in range(4):
                got = down.recv(timeout=5)
                h, labels, mask = sent[step * 4 + micro]
                assert (got.kind, got.step, got.micro) == ("activation", step, micro)
                assert got.meta == {"tokens": 32, "note": "é"}
                assert torch.equal(got.tensors["h"], h)
                assert torch.equal(got.tensors["labels"], labels)
                assert torch.equal(got.tensors["mask"], mask)
        # Gradients flow back on the same link while activations flow forward.
        grad = torch.randn(2, 16, 64)
        down.send(Frame("gradient", 2, 3, {"grad": grad}), "int8")
        back = up.recv(timeout=5)
        assert (back.step, back.micro) == (2, 3)
        assert torch.allclose(back.tensors["grad"], grad, atol=grad.abs().max().item() / 250)
        assert up.bytes_sent == down.bytes_received and down.bytes_sent == up.bytes_received


def test_compressed_frames_shrink_on_the_wire_and_decode_close(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        h = torch.randn(4, 512, 576)  # a micro-batch of 4 x 512 tokens at SmolLM2's width
        sizes = {}
        for mode in ("bf16", "int8", "int4"):
            before = up.bytes_sent
            labels = torch.randint(-100, 49152, (4, 512))
            up.send(Frame("activation", 0, 0, {"h": h, "labels": labels}), mode)
            got_frame = down.recv(timeout=5)
            assert torch.equal(got_frame.tensors["labels"], labels)
            got = got_frame.tensors["h"]
            sizes[mode] = up.bytes_sent - before
            assert got.dtype == torch.float32 and got.shape == h.shape
            assert ((got - h).norm() / h.norm()).item() < {
                "bf16": 4e-3,
                "int8": 0.01,
                "int4": 0.15,
            }[mode]
        assert sizes["int8"] / sizes["bf16"] <= 0.52
        assert sizes["int4"] / sizes["bf16"] <= 0.27


def test_large_frames_span_several_records(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        big = torch.randn(3, 1024, 1024)  # 12 MiB > one 4 MiB record
        empty = torch.empty(0, 4, dtype=torch.bfloat16)
        t, out = _in_thread(lambda: down.recv(timeout=30))
        up.send(Frame("activation", 7, 1, {"empty": empty, "h": big, "s": torch.tensor(2.5)}))
        t.join(30)
        got = out["value"]
        assert isinstance(got, Frame) and torch.equal(got.tensors["h"], big)
        assert got.tensors["empty"].shape == (0, 4) and got.tensors["empty"].dtype == torch.bfloat16
        assert got.tensors["s"].shape == () and got.tensors["s"].item() == 2.5


def test_wrong_secret_is_refused_with_a_clear_message_and_logged(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    with caplog.at_level(logging.WARNING, logger="relaytrain.links"):
        with pytest.raises(AuthError, match="could not prove it holds the secret of job"):
            connect(_addr(listener), secret=b"x" * 32, job_id=JOB, stage=0, retry_for=5)
        # The listener keeps waiting and accepts the right peer afterwards.
        good = connect(_addr(listener), secret=SECRET, job_id=JOB, stage=0, retry_for=5)
        t.join(10)
    assert isinstance(out.get("value"), Link)
    assert any(
        "Refused link" in r.getMessage() and "secret" in r.getMessage() for r in caplog.records
    )
    good.close()
    out_link = out["value"]
    assert isinstance(out_link, Link)
    out_link.close()


@pytest.mark.parametrize(
    ("job", "stage", "message"),
    [("other/job", 0, "belongs to job 'other/job'"), (JOB, 2, "accepts only stage 0")],
)
def test_wrong_job_or_wrong_neighbour_is_refused(
    listener: Listener, job: str, stage: int, message: str
) -> None:
    t, _ = _in_thread(lambda: listener.accept(timeout=0.5))
    with pytest.raises(AuthError, match=message):
        connect(_addr(listener), secret=SECRET, job_id=job, stage=stage, retry_for=5)
    t.join(5)


def test_a_listener_with_the_wrong_secret_gets_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with listen("127.0.0.1:0", secret=b"y" * 32, job_id=JOB, stage=1) as impostor:
        t, out = _in_thread(lambda: impostor.accept(timeout=1))
        with pytest.raises(AuthError):
            connect(_addr(impostor), secret=SECRET, job_id=JOB, stage=0, retry_for=5)
        t.join(10)
    assert isinstance(out.get("error"), TimeoutError)  # it never got a link


class _Proxy:
    """A man in the middle on the upstream->downstream direction, after the handshake."""

    def __init__(self, target: str, mutate: Callable[[int, bytes], list[bytes]]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.target = target
        self.mutate = mutate
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        host, port = self.target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        hello = _read(client, 43)
        hello += _read(client, struct.unpack(">H", hello[-2:])[0])
        upstream.sendall(hello)  # hello and proof pass untouched
        upstream.sendall(_read(client, 32))
        index = 0
        try:
            while True:
                prefix = _read(client, 4)
                record = prefix + _read(client, struct.unpack(">I", prefix)[0])
                for chunk in self.mutate(index, record):
                    upstream.sendall(chunk)
                index += 1
        except OSError:
            pass
        finally:
            for sock in (client, upstream, self.server):
                sock.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _flip(index: int, record: bytes) -> list[bytes]:
    if index == 1:
        record = record[:10] + bytes([record[10] ^ 0x01]) + record[11:]
    return [record]


def _replay(index: int, record: bytes) -> list[bytes]:
    return [record, record] if index == 0 else [record]


@pytest.mark.parametrize("mutate", [_flip, _replay])
def test_tampered_or_replayed_records_are_rejected(
    listener: Listener, mutate: Callable[[int, bytes], list[bytes]]
) -> None:
    proxy = _Proxy(_addr(listener), mutate)
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    up = connect(proxy.addr, secret=SECRET, job_id=JOB, stage=0, retry_for=5)
    t.join(10)
    down = out["value"]
    assert isinstance(down, Link)
    with up, down:
        up.send(Frame("control", 0, -1, meta={"n": 0}))  # record 0
        up.send(Frame("control", 1, -1, meta={"n": 1}))  # record 1
        assert down.recv(timeout=5).meta == {"n": 0}
        with pytest.raises(FrameRejected, match="failed authentication"):
            down.recv(timeout=5)
        assert down.closed  # an untrusted link is dropped, never resynchronised
        with pytest.raises(LinkBroken):
            down.recv(timeout=1)


def test_close_on_one_side_breaks_the_other_promptly(listener: Listener) -> None:
    up, down = _pair(listener)
    t, out = _in_thread(lambda: down.recv(timeout=30))
    time.sleep(0.2)
    start = time.monotonic()
    up.close()
    t.join(5)
    assert isinstance(out.get("error"), LinkBroken)
    assert time.monotonic() - start < 2
    with pytest.raises(LinkBroken):
        up.send(Frame("control", 0, -1))


def test_a_killed_peer_process_raises_link_broken_promptly(
    listener: Listener, tmp_path: Path
) -> None:
    script = tmp_path / "peer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, torch
            from relaytrain_worker.transport import Frame, connect
            link = connect({_addr(listener)!r}, secret={SECRET!r}, job_id={JOB!r}, stage=0)
            link.send(Frame("activation", 0, 0, {{"h": torch.ones(4)}}))
            time.sleep(60)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["worker_image", *sys.path])}
    peer = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        down = listener.accept(timeout=60)
        assert torch.equal(down.recv(timeout=30).tensors["h"], torch.ones(4))
        t, out = _in_thread(lambda: down.recv(timeout=30))
        os.kill(peer.pid, signal.SIGKILL)
        start = time.monotonic()
        t.join(10)
        assert isinstance(out.get("error"), LinkBroken), out
        assert time.monotonic() - start < 2
    finally:
        peer.kill()
        peer.wait()


def test_connect_retries_until_the_listener_appears() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    t, out = _in_thread(
        lambda: connect(f"127.0.0.1:{port}", secret=SECRET, job_id=JOB, stage=0, retry_for=20)
    )
    time.sleep(1.0)
    assert t.is_alive()  # still retrying
    with listen(f"127.0.0.1:{port}", secret=SECRET, job_id=JOB, stage=1) as late:
        down = late.accept(timeout=15)
        t.join(15)
        up = out["value"]
        assert isinstance(up, Link)
        up.send(Frame("control", 0, -1, meta={"hello": True}))
        assert down.recv(timeout=5).meta == {"hello": True}
        up.close()
        down.close()


def test_connect_gives_up_after_retry_for() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    start = time.monotonic()
    with pytest.raises(LinkBroken, match=f"could not reach 127.0.0.1:{port} within 1 s"):
        connect(f"127.0.0.1:{port}", secret=SECRET, job_id=JOB, stage=0, retry_for=1.0)
    assert time.monotonic() - start < 3


def test_recv_timeout_leaves_the_link_usable(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        with pytest.raises(TimeoutError):
            down.recv(timeout=0.1)
        up.send(Frame("control", 4, -1))
        assert down.recv(timeout=5).step == 4


def test_short_secrets_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        listen("127.0.0.1:0", secret=b"short", job_id=JOB, stage=1)


def test_closing_a_listener_wakes_a_blocked_accept() -> None:
    lst = listen("127.0.0.1:0", secret=SECRET, job_id=JOB, stage=1)
    t, out = _in_thread(lst.accept)
    time.sleep(0.2)
    lst.close()
    t.join(5)
    assert isinstance(out.get("error"), LinkBroken)
    with (
        listen("127.0.0.1:0", secret=SECRET, job_id=JOB, stage=1) as idle,
        pytest.raises(TimeoutError),
    ):
        idle.accept(timeout=0)


def test_both_directions_carry_large_frames_at_once(listener: Listener) -> None:
    # 1F1B: activations go down while gradients come up; each side sends on its own thread.
    up, down = _pair(listener)
    with up, down:
        fwd = [torch.randn(2, 512, 1024) for _ in range(3)]  # 4 MiB each, > socket buffers
        bwd = [torch.randn(2, 512, 1024) for _ in range(3)]
        t1, _ = _in_thread(
            lambda: [up.send(Frame("activation", 0, i, {"h": h})) for i, h in enumerate(fwd)]
        )
        t2, _ = _in_thread(
            lambda: [down.send(Frame("gradient", 0, i, {"g": g})) for i, g in enumerate(bwd)]
        )
        got_fwd = [down.recv(timeout=30) for _ in fwd]
        got_bwd = [up.recv(timeout=30) for _ in bwd]
        t1.join(30)
        t2.join(30)
        assert all(torch.equal(f.tensors["h"], h) for f, h in zip(got_fwd, fwd, strict=True))
        assert all(torch.equal(f.tensors["g"], g) for f, g in zip(got_bwd, bwd, strict=True))


def test_a_peer_that_stalls_mid_frame_is_declared_gone(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relaytrain_worker.transport as transport

    monkeypatch.setattr(transport, "STALL_TIMEOUT", 0.5)
    up, down = _pair(listener)
    with up, down:
        up._sock.sendall(struct.pack(">I", 100) + b"x" * 10)  # a record that never completes
        start = time.monotonic()
        with pytest.raises(LinkBroken, match="stalled"):
            down.recv(timeout=5)
        assert time.monotonic() - start < 3


def test_a_rate_limited_link_emulates_a_slow_network(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        up.limit_rate(20e6)  # 20 MB/s, i.e. a 160 Mbit/s link
        h = torch.randn(2_000_000)  # 8 MB -> at least 0.4 s on the wire
        t, out = _in_thread(lambda: down.recv(timeout=30))
        start = time.monotonic()
        up.send(Frame("activation", 0, 0, {"h": h}))
        t.join(30)
        elapsed = time.monotonic() - start
        assert isinstance(out.get("value"), Frame)
        assert 0.39 <= elapsed < 3.0
        up.limit_rate(None)
        start = time.monotonic()
        up.send(Frame("control", 1, -1))
        assert down.recv(timeout=5).step == 1
        assert time.monotonic() - start < 0.3


def test_frames_prepared_ahead_go_out_in_send_order(listener: Listener) -> None:
    # Encoding frame i+1 on one thread while frame i is on the wire keeps a slow link busy.
    up, down = _pair(listener)
    with up, down:
        hs = [torch.randn(256, 64) for _ in range(3)]
        prepared = [prepare(Frame("activation", 0, i, {"h": h}), "int8") for i, h in enumerate(hs)]
        for p in prepared:
            up.send_prepared(p)
        for i, h in enumerate(hs):
            got = down.recv(timeout=5)
            assert got.micro == i
            assert torch.allclose(got.tensors["h"], h, atol=h.abs().max().item() / 100)
        assert up.payload_bytes_sent < up.raw_bytes_sent / 3
