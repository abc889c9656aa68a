"""Links between stages over loopback: ordering, mutual TLS, identities, failures."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from cryptography import x509
from relaytrain_contract import LINK_CA_FILE, LINK_CERT_FILE, LINK_KEY_FILE
from relaytrain_operator.domain.linkcerts import StagePem, mint_link_credentials, stage_pem
from relaytrain_testkit.harness.ports import free_port
from relaytrain_testkit.harness.waiting import running, wait_for
from relaytrain_testkit.linkcreds import stage_credentials
from relaytrain_worker.pipeline import frames
from relaytrain_worker.pipeline.transport import (
    AuthError,
    CertificateRefused,
    Frame,
    FrameRejected,
    Link,
    LinkBroken,
    LinkCredentials,
    Listener,
    PlanReplaced,
    StalePeer,
    connect,
    listen,
    prepare,
)

pytestmark = pytest.mark.unit

NS, JOB = "default", "smollm-lora"
FILES = mint_link_credentials(NS, JOB, [3], now=datetime.now(UTC))
CREDS = [LinkCredentials(*stage_pem(FILES, 0, k)) for k in range(3)]
S0, S1, S2 = (f"relaytrain://{NS}/{JOB}/p0/s{k}" for k in range(3))


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = listen("127.0.0.1:0", credentials=CREDS[1], expect=S0)
    yield lst
    lst.close()


def _connect(addr: str, creds: LinkCredentials = CREDS[0], expect: str = S1, **kw: float) -> Link:
    return connect(addr, credentials=creds, expect=expect, retry_for=kw.get("retry_for", 5))


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


def _pair(lst: Listener, creds: LinkCredentials = CREDS[0]) -> tuple[Link, Link]:
    """(upstream link of stage 0, downstream link of stage 1)."""
    t, out = _in_thread(lambda: lst.accept(timeout=10))
    up = _connect(_addr(lst), creds)
    t.join(10)
    down = out["value"]
    assert isinstance(down, Link)
    return up, down


def test_frames_arrive_in_order_with_ids_tensors_and_meta(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        # Each end knows who the other proved to be.
        assert (down.peer_identity, up.peer_identity) == (S0, S1)
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


def test_large_frames_span_many_tls_records(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        big = torch.randn(3, 1024, 1024)  # 12 MiB: 768 records of 16 KiB
        empty = torch.empty(0, 4, dtype=torch.bfloat16)
        t, out = _in_thread(lambda: down.recv(timeout=30))
        up.send(Frame("activation", 7, 1, {"empty": empty, "h": big, "s": torch.tensor(2.5)}))
        t.join(30)
        got = out["value"]
        assert isinstance(got, Frame) and torch.equal(got.tensors["h"], big)
        assert got.tensors["empty"].shape == (0, 4) and got.tensors["empty"].dtype == torch.bfloat16
        assert got.tensors["s"].shape == () and got.tensors["s"].item() == 2.5


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Refused link")]


def _retries(caplog: pytest.LogCaptureFixture, port: int) -> list[str]:
    """The failed attempts to connect to the port that `connect` logged (it retries each)."""
    prefix = f"Connecting to 127.0.0.1:{port} failed"
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def _no_link_within(listener: Listener, seconds: float) -> dict[str, object]:
    """Run accept in a thread; the caller checks it got no link (it timed out)."""
    t, out = _in_thread(lambda: listener.accept(timeout=seconds))
    out["thread"] = t
    return out


def test_a_stage_of_another_job_is_refused_naming_what_was_expected(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    # Another job's stage 0: its own CA, the same stage number and job-like identity.
    other = stage_credentials(3, namespace=NS, job="other-job")
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    with caplog.at_level(logging.WARNING, logger="relaytrain.links"):
        with pytest.raises(CertificateRefused) as refused:
            _connect(_addr(listener), other[0], retry_for=0)  # one try (see the retry below)
        # The listener keeps waiting and accepts the right peer afterwards.
        good = _connect(_addr(listener))
        t.join(10)
    # The intruder is told why, and what the listener is expected to be.
    assert "does not verify against this job's link CA" in str(refused.value)
    assert f"expected {S1}" in str(refused.value)
    (logged,) = _refusals(caplog)
    assert "refused this stage's certificate" in logged and "UNKNOWN_CA" in logged
    assert f"expected it to be {S0}" in logged
    down = out["value"]
    assert isinstance(down, Link) and down.peer_identity == S0
    good.close()
    down.close()


def test_a_stage_of_the_link_protocol_before_is_refused_naming_this_one(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage of the relaytrain before (relaytrain-link/4: each frame's gradient decoded in
    rotation 0, the wrong direction) is refused at the handshake, naming the protocol spoken
    here, and never exchanges a frame; the listener carries on."""
    from relaytrain_worker.pipeline import credentials, linkauth

    monkeypatch.setattr(credentials, "ALPN", "relaytrain-link/4")
    older = LinkCredentials(*stage_pem(FILES, 0, 0))  # its contexts offer the old protocol
    monkeypatch.undo()
    assert linkauth.ALPN == "relaytrain-link/5"
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    with pytest.raises(AuthError, match="does not speak relaytrain-link/5"):
        _connect(_addr(listener), older, retry_for=0)
    good = _connect(_addr(listener))
    t.join(10)
    down = out["value"]
    assert isinstance(down, Link) and down.peer_identity == S0
    good.close()
    down.close()


def test_a_listener_of_another_job_never_gets_a_frame() -> None:
    impostor_creds = stage_credentials(3, namespace=NS, job=JOB)  # same names, another CA
    with listen("127.0.0.1:0", credentials=impostor_creds[1], expect=S0) as impostor:
        out = _no_link_within(impostor, 2)
        with pytest.raises(CertificateRefused, match=f"does not verify against .*expected {S1}"):
            _connect(_addr(impostor), retry_for=0)
        out["thread"].join(10)  # type: ignore[attr-defined]
    assert isinstance(out.get("error"), TimeoutError)  # it never got a link


def test_the_right_ca_but_the_wrong_stage_is_refused_both_ways(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    # Stage 2 of the same job tries to feed stage 1: only stage 0 may.
    out = _no_link_within(listener, 2)
    refusal = f"refused the link: the peer is {S2}, but {S1} accepts only {S0}"
    with (
        caplog.at_level(logging.WARNING, logger="relaytrain.links"),
        pytest.raises(AuthError, match=refusal),
    ):
        _connect(_addr(listener), CREDS[2])
    out["thread"].join(10)  # type: ignore[attr-defined]
    assert isinstance(out.get("error"), TimeoutError)
    assert any(f"the peer is {S2}, but {S1} accepts only {S0}" in m for m in _refusals(caplog))
    # Stage 0 reaches a listener that turns out to be stage 2: it refuses to send to it.
    with listen("127.0.0.1:0", credentials=CREDS[2], expect=S0) as wrong:
        out = _no_link_within(wrong, 2)
        with pytest.raises(AuthError, match=f"the peer is {S2}, but {S0} connects only to {S1}"):
            _connect(_addr(wrong))
        out["thread"].join(10)  # type: ignore[attr-defined]
    assert isinstance(out.get("error"), TimeoutError)


def _of_plan(stage: int, plan: int) -> LinkCredentials:
    creds = LinkCredentials(*stage_pem(FILES, 0, stage))  # the same CA and identities
    creds.plan = plan
    return creds


def test_a_stage_of_a_replaced_plan_is_told_so_and_never_links_to_its_replacements(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Plan 1 replaced every stage of plan 0 (a re-split); plan 0's stage 0 still runs, on a
    # node cut off, with the same certificate as plan 1's stage 0.
    zombie, new_s0, new_s1 = _of_plan(0, 0), _of_plan(0, 1), _of_plan(1, 1)
    with listen("127.0.0.1:0", credentials=new_s1, expect=S0) as lst:
        t, out = _in_thread(lambda: lst.accept(timeout=10))
        # The zombie learns that its plan is over, naming both plans.
        with pytest.raises(PlanReplaced, match=r"is a stage of plan 1 of this job, .* plan 0"):
            _connect(_addr(lst), zombie)
        # The new stage 1 waited on; its real peer, of its own plan, links.
        good = _connect(_addr(lst), new_s0)
        t.join(10)
        down = out["value"]
        assert isinstance(down, Link) and down.peer_identity == S0
        good.send(Frame("activation", 7, 0, {"h": torch.ones(2)}))
        assert down.recv(timeout=5).step == 7
        good.close()
        down.close()
    # A stage of plan 1 that reaches plan 0's listener: the zombie's accept ends its plan,
    # and the new stage keeps trying (a peer not there yet), then gives up naming why.
    with listen("127.0.0.1:0", credentials=_of_plan(1, 0), expect=S0) as old:
        t, out = _in_thread(lambda: old.accept(timeout=10))
        with (
            caplog.at_level(logging.WARNING, logger="relaytrain.links"),
            pytest.raises(LinkBroken, match=f"could not reach {_addr(old)}"),
        ):
            connect(_addr(old), credentials=new_s0, expect=S1, retry_for=0.5)
        t.join(10)
        (tried,) = _retries(caplog, old.address[1])
        assert "is a stage of plan 0, which this stage's plan 1 replaced" in tried
        assert isinstance(out.get("error"), PlanReplaced)
        assert "which replaced every stage of plan 0" in str(out["error"])
    assert issubclass(StalePeer, LinkBroken) and issubclass(PlanReplaced, AuthError)


def test_an_expired_certificate_is_refused() -> None:
    old = stage_credentials(2, namespace=NS, job=JOB, now=datetime.now(UTC) - timedelta(days=40))
    with listen("127.0.0.1:0", credentials=old[1], expect=S0) as lst:
        out = _no_link_within(lst, 2)
        with pytest.raises(CertificateRefused, match="certificate has expired"):
            _connect(_addr(lst), old[0], retry_for=0)
        out["thread"].join(10)  # type: ignore[attr-defined]
    with pytest.raises(AuthError, match="expired at"):
        old[0].check_valid()


def test_a_plaintext_peer_is_refused_and_the_listener_carries_on(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    with caplog.at_level(logging.WARNING, logger="relaytrain.links"):
        # Raw TCP: the old link protocol's hello, no TLS.
        with socket.create_connection(listener.address, timeout=5) as raw:
            raw.sendall(b"RTL1\x01" + b"\x00" * 32 + b"\x00\x00\x00\x00\x00\x04test")
            assert raw.recv(4096) == b""  # closed on it, nothing sent back
        good = _connect(_addr(listener))
        t.join(10)
    assert any("does not speak TLS" in m for m in _refusals(caplog)), caplog.text
    assert isinstance(out.get("value"), Link)
    good.close()
    out["value"].close()  # type: ignore[attr-defined]


def test_a_plaintext_listener_is_refused() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def answer_in_plaintext() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            time.sleep(1)

    t, _ = _in_thread(answer_in_plaintext)
    with pytest.raises(AuthError, match=f"does not speak TLS.*expected {S1}"):
        _connect(f"127.0.0.1:{server.getsockname()[1]}")
    t.join(5)
    server.close()


class _Proxy:
    """A man in the middle between stage 0 and stage 1, forwarding TLS records.

    Once ``armed`` is set (after the handshake) the next record from stage 0 is passed to
    ``mutate``, which returns what to forward instead.
    """

    def __init__(self, target: tuple[str, int], mutate: Callable[[bytes], list[bytes]]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.target = target
        self.mutate = mutate
        self.armed = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.server.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        try:
            while True:
                head = _read(client, 5)  # TLS record: type, version, u16 length
                record = head + _read(client, int.from_bytes(head[3:5], "big"))
                if self.armed.is_set():
                    self.armed.clear()
                    for chunk in self.mutate(record):
                        upstream.sendall(chunk)
                else:
                    upstream.sendall(record)
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


def _flip(record: bytes) -> list[bytes]:
    """One bit of ciphertext flipped (the record header is left alone)."""
    return [record[:12] + bytes([record[12] ^ 0x01]) + record[13:]]


def _replay(record: bytes) -> list[bytes]:
    return [record, record]


@pytest.mark.parametrize("mutate", [_flip, _replay])
def test_tampered_or_replayed_records_break_the_link(
    listener: Listener, mutate: Callable[[bytes], list[bytes]]
) -> None:
    proxy = _Proxy(listener.address, mutate)
    t, out = _in_thread(lambda: listener.accept(timeout=10))
    up = _connect(proxy.addr)
    t.join(10)
    down = out["value"]
    assert isinstance(down, Link)
    with up, down:
        up.send(Frame("control", 0, -1, meta={"n": 0}))
        assert down.recv(timeout=5).meta == {"n": 0}
        proxy.armed.set()
        up.send(Frame("control", 1, -1, meta={"n": 1}))
        delivered = []
        with pytest.raises(FrameRejected, match=r"failed authentication.*tampered with"):
            for _ in range(2):  # a replayed copy fails right after the genuine record
                delivered.append(down.recv(timeout=5).meta)
        assert delivered == ([{"n": 1}] if mutate is _replay else [])
        assert down.closed  # an untrusted link is dropped, never resynchronised
        with pytest.raises(LinkBroken):
            down.recv(timeout=1)


def test_close_on_one_side_breaks_the_other_promptly(listener: Listener) -> None:
    up, down = _pair(listener)
    t, out = _in_thread(lambda: down.recv(timeout=30))
    wait_for("recv to wait for data", lambda: running(t, "Link._wait_readable"), timeout=5)
    up.close()
    t.join(30)
    # LinkBroken, not the TimeoutError recv's 30 s would end in: the close woke it.
    assert isinstance(out.get("error"), LinkBroken), out
    with pytest.raises(LinkBroken):
        up.send(Frame("control", 0, -1))


def test_a_link_closed_by_another_thread_as_recv_polls_raises_link_broken(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's sender thread closes its link when a send fails (peers.Peer._fail) while the
    stage's own thread may be in recv on that link, past its check that the link is open.
    That recv must raise LinkBroken, which a stage answers by linking again: it once raised
    "ValueError: file descriptor cannot be a negative integer (-1)" from polling the closed
    socket, and the stage died and was replaced for nothing (a chaos run's stage 1, whose
    upstream had been killed). The close is made to land in that very gap."""
    import select as real_select

    import relaytrain_worker.pipeline.transport as transport

    up, down = _pair(listener)
    sock = down._sock

    class ClosedMeanwhile:
        POLLIN, POLLERR, POLLHUP = real_select.POLLIN, real_select.POLLERR, real_select.POLLHUP

        @staticmethod
        def poll() -> object:
            sock.close()  # the other thread's close, after recv checked the link was open
            return real_select.poll()

    monkeypatch.setattr(transport, "select", ClosedMeanwhile)
    try:
        with pytest.raises(LinkBroken, match="closed"):
            down.recv(timeout=5)
        assert down.peer_gone()
    finally:
        up.close()
        down.close()


def test_a_peer_gone_mid_frame_raises_link_broken_and_does_not_spin(listener: Listener) -> None:
    """A peer that dies part-way through a frame (its TLS records end without a close):
    the receiver's recv raises LinkBroken. It once spun forever on the closed socket at
    100 % CPU (a stage whose upstream container was killed mid-send)."""
    up, down = _pair(listener)
    # Half a frame: a header of 100 bytes announced, 10 of them sent, then the peer's end
    # is gone without a TLS close (as the kernel closes a killed process's socket).
    sealed = up._tls.seal(struct.pack(">I", 100) + b"{" * 10)
    up._sock.sendall(sealed[:20])
    up._sock.shutdown(socket.SHUT_RDWR)
    try:
        t, out = _in_thread(lambda: down.recv(timeout=30))
        t.join(30)
        assert not t.is_alive(), "recv still runs on a link whose peer is gone"
        assert isinstance(out.get("error"), LinkBroken), out
    finally:
        up.close()
        down.close()


def test_a_header_that_does_not_inflate_breaks_the_link_naming_why(listener: Listener) -> None:
    """A `delta` frame's header goes deflated (frames.head_bytes); one whose bytes do not
    inflate is a malformed frame, and the receiver says which part of it was wrong."""
    up, down = _pair(listener)
    head = frames.DEFLATED_HEAD + b"\xff" * 40  # the deflated mark, then no DEFLATE stream
    up._send_bytes(struct.pack(">I", len(head)) + head)
    try:
        with pytest.raises(LinkBroken, match=r"malformed frame .*header does not inflate"):
            down.recv(timeout=30)
    finally:
        up.close()
        down.close()


def test_a_killed_peer_process_raises_link_broken_promptly(
    listener: Listener, tmp_path: Path
) -> None:
    script = tmp_path / "peer.py"
    folder = tmp_path / "creds"
    _write_folder(folder, stage_pem(FILES, 0, 0))
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time, torch
            from relaytrain_worker.pipeline.transport import Frame, LinkCredentials, connect
            creds = LinkCredentials.from_folder({str(folder)!r})
            link = connect({_addr(listener)!r}, credentials=creds, expect={S1!r})
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
        t, out = _in_thread(lambda: down.recv(timeout=60))
        os.kill(peer.pid, signal.SIGKILL)
        t.join(60)
        # LinkBroken, not the TimeoutError recv's 60 s would end in: the death woke it.
        assert isinstance(out.get("error"), LinkBroken), out
    finally:
        peer.kill()
        peer.wait()


def test_connect_retries_until_the_listener_appears(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nothing listens there yet
    with caplog.at_level(logging.DEBUG, logger="relaytrain.links"):
        t, out = _in_thread(lambda: _connect(f"127.0.0.1:{port}", retry_for=20))
        wait_for("two failed attempts", lambda: len(_retries(caplog, port)) >= 2, timeout=10)
    assert t.is_alive() and "error" not in out  # still retrying
    with listen(f"127.0.0.1:{port}", credentials=CREDS[1], expect=S0) as late:
        down = late.accept(timeout=15)
        t.join(15)
        up = out["value"]
        assert isinstance(up, Link)
        up.send(Frame("control", 0, -1, meta={"hello": True}))
        assert down.recv(timeout=5).meta == {"hello": True}
        up.close()
        down.close()


def test_connect_gives_up_after_retry_for() -> None:
    port = free_port()
    with pytest.raises(LinkBroken, match=f"could not reach 127.0.0.1:{port} within 1 s"):
        _connect(f"127.0.0.1:{port}", retry_for=1.0)


def test_recv_timeout_leaves_the_link_usable(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        with pytest.raises(TimeoutError):
            down.recv(timeout=0.1)
        up.send(Frame("control", 4, -1))
        assert down.recv(timeout=5).step == 4


def test_credentials_that_do_not_fit_are_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    cert0, _, ca = stage_pem(FILES, 0, 0)
    _, key1, _ = stage_pem(FILES, 0, 1)
    with pytest.raises(AuthError, match="do not load"):
        LinkCredentials(cert0, key1, ca)  # stage 1's key with stage 0's certificate
    with pytest.raises(AuthError, match="not a PEM certificate"):
        LinkCredentials("not a certificate", key1, ca)
    folder = tmp_path / "creds"
    _write_folder(folder, StagePem(cert0, "", ca))
    where = re.escape(str(folder))
    with pytest.raises(AuthError, match=rf"tls.key in {where} \(link credentials\) is missing"):
        LinkCredentials.from_folder(folder)
    (folder / LINK_KEY_FILE).unlink()
    with pytest.raises(AuthError, match=rf"tls.key in {where} .* is missing or empty"):
        LinkCredentials.from_folder(folder)
    (folder / LINK_KEY_FILE).write_text(key1)
    with pytest.raises(AuthError, match=rf"do not load .*files in {where}"):
        LinkCredentials.from_folder(folder)


def test_closing_a_listener_wakes_a_blocked_accept() -> None:
    lst = listen("127.0.0.1:0", credentials=CREDS[1], expect=S0)
    t, out = _in_thread(lst.accept)
    wait_for("accept to wait for a peer", lambda: running(t, "socket.accept"), timeout=5)
    lst.close()
    t.join(5)
    assert isinstance(out.get("error"), LinkBroken)
    with (
        listen("127.0.0.1:0", credentials=CREDS[1], expect=S0) as idle,
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
    import relaytrain_worker.pipeline.transport as transport

    monkeypatch.setattr(transport, "STALL_TIMEOUT", 0.5)
    up, down = _pair(listener)
    with up, down:
        up._sock.sendall(b"\x17\x03\x03\x00\x64" + b"x" * 10)  # a TLS record that never completes
        with pytest.raises(LinkBroken, match="stalled"):  # not recv's own TimeoutError
            down.recv(timeout=30)


def test_a_rate_limited_link_emulates_a_slow_network(listener: Listener) -> None:
    up, down = _pair(listener)
    with up, down:
        h = torch.randn(2_000_000)  # 8 MB -> at least 0.4 s on the wire at 20 MB/s

        def delivery(step: int) -> float:
            t, out = _in_thread(lambda: down.recv(timeout=30))
            start = time.monotonic()
            up.send(Frame("activation", step, 0, {"h": h}))
            t.join(30)
            assert isinstance(out.get("value"), Frame) and out["value"].step == step
            return time.monotonic() - start

        up.limit_rate(20e6)  # 20 MB/s, i.e. a 160 Mbit/s link
        paced = delivery(0)
        assert paced >= 0.39  # a floor only: a busy machine is slower, never faster
        up.limit_rate(None)
        # Side by side with the paced send, not against a clock: lifted, the same frame
        # goes out faster than the limit would let it.
        assert delivery(1) < paced


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


# -- credentials from a folder, renewed while links run ----------------------------------


def _write_folder(folder: Path, pem: StagePem) -> None:
    """The three files, written in place one by one (a writer that is not atomic)."""
    folder.mkdir(exist_ok=True)
    for name, text in zip((LINK_CERT_FILE, LINK_KEY_FILE, LINK_CA_FILE), pem, strict=True):
        (folder / name).write_text(text)


def _kubelet_update(folder: Path, pem: StagePem) -> None:
    """Write the files as the kubelet updates a mounted Secret: into a new timestamped
    folder, then `..data` swapped to it at once (rename over it); the three names are links
    through `..data`; the previous generation is deleted."""
    folder.mkdir(exist_ok=True)
    data = folder / "..data"
    previous = data.resolve() if data.is_symlink() else None
    generation = folder / f"..{time.monotonic_ns()}"
    generation.mkdir()
    names = (LINK_CERT_FILE, LINK_KEY_FILE, LINK_CA_FILE)
    for name, text in zip(names, pem, strict=True):
        (generation / name).write_text(text)
    (folder / "..data_tmp").symlink_to(generation.name)
    os.replace(folder / "..data_tmp", data)
    for name in names:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    if previous is not None:
        shutil.rmtree(previous)


def _peer_cert(link: Link) -> bytes:
    """The certificate (DER) the link's peer presented when the link was opened."""
    der = link._tls._obj.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(pem: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem)


def _generations() -> tuple[dict[str, str], dict[str, str], str]:
    """A job's credentials before and after a renewal (a day apart, each with its own CA),
    and the bundle of both CAs that `ca.crt` holds during the renewal."""
    old = mint_link_credentials(NS, JOB, [2], now=datetime.now(UTC) - timedelta(days=1))
    new = mint_link_credentials(NS, JOB, [2], now=datetime.now(UTC))
    return old, new, stage_pem(old, 0, 0).ca + stage_pem(new, 0, 0).ca


def _talk(up: Link, down: Link, step: int) -> None:
    """A frame each way over a pair of links."""
    up.send(Frame("control", step, -1, meta={"down": step}))
    assert down.recv(timeout=5).meta == {"down": step}
    down.send(Frame("control", step, -1, meta={"up": step}))
    assert up.recv(timeout=5).meta == {"up": step}


def test_renewed_credentials_serve_new_links_while_links_opened_before_carry_on(
    tmp_path: Path,
) -> None:
    old, new, bundle = _generations()
    f0, f1 = tmp_path / "s0", tmp_path / "s1"
    _kubelet_update(f0, stage_pem(old, 0, 0))
    _kubelet_update(f1, stage_pem(old, 0, 1))
    me0, me1 = LinkCredentials.from_folder(f0), LinkCredentials.from_folder(f1)
    with listen("127.0.0.1:0", credentials=me1, expect=S0) as lst:
        before = _pair(lst, me0)
        # Mid-renewal: both stages trust both CAs; stage 0 already holds the new CA's
        # certificate, stage 1 still the old one.
        _kubelet_update(f1, stage_pem(old, 0, 1)._replace(ca=bundle))
        _kubelet_update(f0, stage_pem(new, 0, 0)._replace(ca=bundle))
        during = _pair(lst, me0)
        assert _peer_cert(during[1]) == _der(stage_pem(new, 0, 0).cert)
        assert _peer_cert(during[0]) == _der(stage_pem(old, 0, 1).cert)
        new_cert = x509.load_pem_x509_certificate(stage_pem(new, 0, 0).cert.encode())
        assert me0.not_after == new_cert.not_valid_after_utc
        # Renewed: the new CA alone.
        _kubelet_update(f1, stage_pem(new, 0, 1))
        _kubelet_update(f0, stage_pem(new, 0, 0))
        after = _pair(lst, me0)
        assert _peer_cert(after[0]) == _der(stage_pem(new, 0, 1).cert)
        # The link opened first keeps its session (old certificates, files long deleted).
        assert _peer_cert(before[1]) == _der(stage_pem(old, 0, 0).cert)
        for step, (up, down) in enumerate((before, during, after)):
            with up, down:
                _talk(up, down, step)


def test_a_half_written_folder_keeps_the_earlier_credentials_until_it_loads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new, bundle = _generations()
    folder = tmp_path / "s0"
    _write_folder(folder, stage_pem(old, 0, 0)._replace(ca=bundle))
    me0 = LinkCredentials.from_folder(folder)
    them = LinkCredentials(*stage_pem(old, 0, 1)._replace(ca=bundle))
    kept = "Kept the earlier link credentials"
    with (
        listen("127.0.0.1:0", credentials=them, expect=S0) as lst,
        caplog.at_level(logging.WARNING, logger="relaytrain.links"),
    ):
        (folder / LINK_CERT_FILE).write_text(stage_pem(new, 0, 0).cert)  # the old key still
        half = [_pair(lst, me0) for _ in range(2)]
        assert all(_peer_cert(down) == _der(stage_pem(old, 0, 0).cert) for _, down in half)
        (warning,) = [m for m in caplog.messages if m.startswith(kept)]  # once, not per link
        assert f"{S0}: the files in {folder} do not load" in warning
        (folder / LINK_KEY_FILE).write_text(stage_pem(new, 0, 0).key)
        whole = _pair(lst, me0)
        assert _peer_cert(whole[1]) == _der(stage_pem(new, 0, 0).cert)
        for step, (up, down) in enumerate([*half, whole]):
            with up, down:
                _talk(up, down, step)


def test_a_folder_that_now_holds_another_stages_credentials_is_refused(
    listener: Listener, tmp_path: Path
) -> None:
    folder = tmp_path / "s0"
    _kubelet_update(folder, stage_pem(FILES, 0, 0))
    me0 = LinkCredentials.from_folder(folder)
    up, down = _pair(listener, me0)
    _kubelet_update(folder, stage_pem(FILES, 0, 2))  # stage 2's, of the same job
    refusal = f"the link certificate in {folder} now names {S2}, but this stage is {S0}"
    with pytest.raises(AuthError, match=re.escape(refusal)):
        _connect(_addr(listener), me0)
    with pytest.raises(AuthError, match=re.escape(refusal)):
        me0.check_valid()
    assert me0.identity == S0
    with up, down:  # the link opened before is unharmed
        _talk(up, down, 0)


def test_a_chain_refused_while_a_renewal_reaches_one_end_first_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The listener already holds the renewed files (the new CA alone); the connector's
    still name the old CA: refused on the chain, both ways. Its files arrive a moment
    later, and the retry (for `refused_for`, the stage document's renewal grace), reading
    them again, links. Without a grace such a refusal is final at once (the tests above)."""
    old, new, _ = _generations()
    folder = tmp_path / "s0"
    _kubelet_update(folder, stage_pem(old, 0, 0))
    me0 = LinkCredentials.from_folder(folder)
    them = LinkCredentials(*stage_pem(new, 0, 1))
    with (
        listen("127.0.0.1:0", credentials=them, expect=S0) as lst,
        caplog.at_level(logging.WARNING, logger="relaytrain.links"),
    ):
        t, out = _in_thread(lambda: lst.accept(timeout=20))
        retried = threading.Event()

        class _Arrives(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("Link refused on the certificate chain"):
                    retried.set()

        handler = _Arrives()
        logging.getLogger("relaytrain.links").addHandler(handler)
        try:
            c, up = _in_thread(
                lambda: connect(
                    _addr(lst), credentials=me0, expect=S1, retry_for=20, refused_for=20
                )
            )
            assert retried.wait(10), "the refusal was not retried"
            _kubelet_update(folder, stage_pem(new, 0, 0))  # the renewal reaches stage 0
            c.join(20)
            t.join(20)
        finally:
            logging.getLogger("relaytrain.links").removeHandler(handler)
    link, down = up.get("value"), out.get("value")
    assert isinstance(link, Link) and isinstance(down, Link), (up, out)
    assert _peer_cert(down) == _der(stage_pem(new, 0, 0).cert)
    with link, down:
        _talk(link, down, 0)
