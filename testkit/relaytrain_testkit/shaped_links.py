"""Slow links shaped by the kernel, for benchmarks and end-to-end tests on one machine.

A command runs in a fresh user and network namespace (``unshare -rn``: no privilege
needed where unprivileged user namespaces are allowed) whose only interface, loopback, is
shaped by a queueing discipline of the kernel:

- ``per_link`` (the default): an ``htb`` class per TCP destination port, every class at the
  rate, chosen by a ``u32`` filter on the port. Every port a process can get in the
  namespace, listening (bound to port 0) or connecting, is one of ``ports`` (the
  namespace's own ``net.ipv4.ip_local_port_range``), so every TCP connection gets a rate
  of its own in each direction (data towards the listener is classed by the listener's
  port, data back by the connecting end's port), as separate real links would, instead of
  all links sharing one loopback bottleneck. Traffic to other ports is not shaped.
  Several connections to one listening port share its class (the listener's downlink).
- ``per_link=False``: one ``tbf`` for everything on loopback, both directions together.

How a process inside learns which ports are shaped: it does not need to; any port it binds
or connects from is in ``ports``. Listeners with fixed ports outside that range are not
shaped. IPv4 only (the filters match IPv4 headers; relaytrain's local links use 127.0.0.1).

Latency and loss: the kernel's emulator of both, ``netem``, is missing from kernels built
without ``sch_netem`` (such as this project's CI machines: "Specified qdisc kind is
unknown"), so latency is emulated above TCP by the links themselves (``Link.set_latency``,
a delay line), and loss by iptables' ``statistic`` match in the namespace
(``Shaping.loss``: each TCP packet dropped with that chance, loopback's packets made
Ethernet-sized meanwhile). TCP retransmits what was lost (fast retransmit after duplicate
acks, or a 200 ms timeout when a tail is lost) and halves its congestion window, so a lossy
link delivers less than its rate; relaytrain's frames still arrive whole and in order, only
later. What this does not emulate: TCP sees loopback's round trip, not the delay line's, so
its recovery is faster than over a long real link.

Usage: ``command([...], Shaping(rate=...))`` builds the argv that runs a command inside
a shaped namespace; ``shape(...)`` re-shapes the namespace the calling process is in
(a benchmark that measures several rates in one namespace); ``class_bytes()`` reads back
what each port's class carried. As a script (stdlib only)::

    python testkit/relaytrain_testkit/shaped_links.py --mbit 50 -- CMD ARGS...

This module imports nothing outside the standard library, so the command that sets up the
namespace runs before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

INSIDE = "RELAYTRAIN_SHAPED_NAMESPACE"
"""Set (to the shaping's description) in the environment of a command run by `command`."""
PORTS = range(20000, 20064)
"""The namespace's ports by default: 64 classes, enough for a few stages' links, metrics
ports and reconnects (a port in TIME_WAIT is not reused for the same peer)."""
MIN_BURST = 70_000
"""Loopback hands the shaper packets of up to 64 KiB (its MTU; GSO); a bucket must hold one."""


@dataclass(frozen=True)
class Shaping:
    """How the namespace's loopback is shaped."""

    rate: float
    """Bytes per second, each direction of each link (``per_link``) or all of loopback."""
    per_link: bool = True
    """An htb class per destination port (each link and direction its own rate); False: one
    tbf for all of loopback."""
    burst: int = MIN_BURST
    """Bytes the token bucket holds: what may pass at once after the link was idle."""
    ports: range = PORTS
    """The namespace's local port range, every port of which is shaped (``per_link``)."""
    loss: float = 0.0
    """The chance that a TCP packet is lost, each one independently (iptables' `statistic`
    match drops it on its way out, so in either direction of every link). With loss,
    loopback carries Ethernet-sized packets (MTU 1500, one segment each), so a loss is one
    packet's, as on a real link, not a 64 KiB loopback segment's; TCP resends it."""

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("the rate must be positive")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss is a probability in [0, 1), not {self.loss}")
        if self.burst < MIN_BURST:
            raise ValueError(f"a burst under {MIN_BURST} bytes cannot pass a loopback packet")
        if not 1024 <= self.ports.start < self.ports.stop <= 65536 or self.ports.step != 1:
            raise ValueError("ports must be a contiguous range of unprivileged ports")

    def describe(self) -> str:
        how = "htb per link" if self.per_link else "tbf on loopback"
        lost = f", {self.loss:.2%} of packets lost" if self.loss else ""
        return f"{how} at {self.rate * 8 / 1e6:g} Mbit/s, burst {self.burst} B{lost}"


def missing() -> str | None:
    """Why shaped namespaces cannot be made here (a sentence), or None when they can."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux / iproute2)"
    probe = "ip link set lo up && tc qdisc add dev lo root handle 1: htb"
    try:
        done = subprocess.run(
            ["unshare", "-rn", "sh", "-c", probe],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare -rn` failed: {e}"
    if done.returncode != 0:
        return (
            f"`unshare -rn sh -c '{probe}'` failed: {done.stderr.strip()} (user and network "
            "namespaces, or the kernel's htb qdisc, are not available to this user)"
        )
    return None


def command(argv: Sequence[str], shaping: Shaping | None, stats: str | None = None) -> list[str]:
    """The argv that runs ``argv`` in a fresh user and network namespace, loopback up and
    shaped by ``shaping`` (None: not shaped yet; the command calls `shape` itself). With
    ``stats`` (a path), ``argv`` runs as a child and, when it ends, the bytes each port's
    class carried (``{"classBytes": {port: bytes}, "dropped": packets}``) are written there.
    """
    flags = [] if shaping is None else ["--rate", repr(shaping.rate), "--burst", str(shaping.burst)]
    if shaping is not None and shaping.loss:
        flags += ["--loss", repr(shaping.loss)]
    if stats is not None:
        flags += ["--stats", stats]
    if shaping is not None and not shaping.per_link:
        flags.append("--tbf")
    ports = shaping.ports if shaping is not None else PORTS
    flags += ["--ports", f"{ports.start}-{ports.stop - 1}"]
    return ["unshare", "-rn", sys.executable, os.path.abspath(__file__), "--setup", *flags,
            "--", *argv]  # fmt: skip


def inside() -> bool:
    """Whether this process runs in a namespace `command` made."""
    return INSIDE in os.environ


def shape(shaping: Shaping) -> None:
    """(Re)shape loopback of the namespace this process is in (made by `command`): replaces
    what shaped it before. The namespace's port range is set to ``shaping.ports``."""
    if not inside():
        raise RuntimeError("shape() outside a namespace made by shaped_links.command()")
    _set_ports(shaping.ports)
    _tc(["qdisc", "del", "dev", "lo", "root"], check=False)  # none yet: fine
    _tc_batch(_rules(shaping))
    _set_loss(shaping.loss)


def unshape() -> None:
    """Take the shaping off loopback of the namespace this process is in (made by
    `command`): every link runs at loopback speed until the next `shape`."""
    if not inside():
        raise RuntimeError("unshape() outside a namespace made by shaped_links.command()")
    _tc(["qdisc", "del", "dev", "lo", "root"], check=False)  # none: fine
    _set_loss(0.0)


def class_bytes() -> dict[int, int]:
    """Per shaped port (``per_link`` shaping): the bytes its class let through so far."""
    ports = _ports()
    out = subprocess.run(
        ["tc", "-s", "class", "show", "dev", "lo"], capture_output=True, text=True, check=True
    ).stdout
    sent: dict[int, int] = {}
    for m in re.finditer(r"class htb 1:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", out):
        minor = int(m.group(1), 16)
        if minor >= 0x100:
            sent[ports.start + minor - 0x100] = int(m.group(2))
    return sent


def dropped() -> int:
    """Packets the namespace's shaper dropped so far (a full queue; TCP resends them)."""
    out = subprocess.run(
        ["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True
    ).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", out))


def lost() -> int:
    """Packets the namespace's loss rule dropped so far (`Shaping.loss`; 0 without one)."""
    if shutil.which("iptables") is None:
        return 0
    out = subprocess.run(["iptables", "-L", "OUTPUT", "-v", "-n", "-x"], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    return sum(int(line.split()[0]) for line in out.splitlines() if "statistic" in line)


# -- internals -----------------------------------------------------------------------


def _set_loss(loss: float) -> None:
    """Replace the namespace's loss rule: none, or drop each TCP packet on loopback with
    probability `loss`, with loopback's packets Ethernet-sized while there is loss."""
    if loss and shutil.which("iptables") is None:
        raise RuntimeError("a lossy link needs `iptables` (its statistic match) in the namespace")
    mtu, segments = ("1500", "1") if loss else ("65536", "65535")
    subprocess.run(["ip", "link", "set", "dev", "lo", "mtu", mtu, "gso_max_segs", segments],
                   check=True, capture_output=True)  # fmt: skip
    if shutil.which("iptables") is not None:
        subprocess.run(["iptables", "-F", "OUTPUT"], check=True, capture_output=True)
    if loss:
        rule = ["-o", "lo", "-p", "tcp", "-m", "statistic", "--mode", "random",
                "--probability", f"{loss:.6f}", "-j", "DROP"]  # fmt: skip
        subprocess.run(["iptables", "-A", "OUTPUT", *rule], check=True, capture_output=True)


_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
"""Per network namespace: a process sees (and, as the namespace's root, sets) its own."""


def _classid(port: int, ports: range) -> str:
    return f"1:{0x100 + port - ports.start:x}"


def _ports() -> range:
    with open(_PORT_RANGE) as f:
        low, high = f.read().split()
    return range(int(low), int(high) + 1)


def _rules(shaping: Shaping) -> list[str]:
    """`tc -batch` lines for ``shaping``."""
    rate, burst = f"{int(shaping.rate)}bps", f"{shaping.burst}b"
    if not shaping.per_link:
        # tbf's queue: generous (TCP's own pacing keeps it short), so nothing is dropped.
        return [f"qdisc add dev lo root handle 1: tbf rate {rate} burst {burst} latency 10s"]
    lines = ["qdisc add dev lo root handle 1: htb"]  # unclassified traffic: not shaped
    for port in shaping.ports:
        cid = _classid(port, shaping.ports)
        lines.append(
            f"class add dev lo parent 1: classid {cid} htb rate {rate} ceil {rate} "
            f"burst {burst} cburst {burst}"
        )
        lines.append(
            f"filter add dev lo parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
            f"match ip dport {port} 0xffff flowid {cid}"
        )
    return lines


def _set_ports(ports: range) -> None:
    with open(_PORT_RANGE, "w") as f:
        f.write(f"{ports.start} {ports.stop - 1}")


def _tc(args: list[str], check: bool = True) -> None:
    subprocess.run(["tc", *args], capture_output=True, check=check)


def _tc_batch(lines: list[str]) -> None:
    done = subprocess.run(
        ["tc", "-batch", "-"],
        check=False,
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tc -batch failed: {done.stderr.strip()}")


def _setup(args: argparse.Namespace) -> None:
    """In the fresh namespace: loopback up, the port range, the shaping; then exec the
    command, or (``--stats FILE``) run it and write what the shaper carried to FILE."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    start, _, stop = args.ports.partition("-")
    ports = range(int(start), int(stop) + 1)
    os.environ[INSIDE] = "unshaped"
    if args.rate is None:
        _set_ports(ports)
    else:
        shaping = Shaping(args.rate, per_link=not args.tbf, burst=args.burst, ports=ports,
                          loss=args.loss)  # fmt: skip
        shape(shaping)
        os.environ[INSIDE] = shaping.describe()
    if args.stats is None:
        os.execvp(args.argv[0], args.argv)
    rc = subprocess.run(args.argv, check=False).returncode
    shaped = {str(port): sent for port, sent in class_bytes().items() if sent}
    with open(args.stats, "w") as f:
        json.dump({"classBytes": shaped, "dropped": dropped(), "lost": lost()}, f)
    sys.exit(rc)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Run a command in a user+network namespace whose loopback is shaped."
    )
    parser.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mbit", type=float, help="rate, Mbit/s (each link, each direction)")
    parser.add_argument("--rate", type=float, help="rate, bytes/s (instead of --mbit)")
    parser.add_argument("--burst", type=int, default=MIN_BURST, help="bucket size, bytes")
    parser.add_argument("--tbf", action="store_true", help="one tbf for all of loopback")
    parser.add_argument(
        "--loss", type=float, default=0.0, help="chance that a packet is lost (0.01: 1 %%)"
    )
    parser.add_argument("--ports", default=f"{PORTS.start}-{PORTS.stop - 1}")
    parser.add_argument("--stats", help="write the bytes each port's class carried here")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.argv and args.argv[0] == "--":
        args.argv = args.argv[1:]
    if not args.argv:
        parser.error("name the command to run after --")
    if args.mbit is not None:
        args.rate = args.mbit * 1e6 / 8
    if args.setup:
        _setup(args)
    start, _, stop = args.ports.partition("-")
    shaping = None
    if args.rate is not None:
        ports = range(int(start), int(stop) + 1)
        shaping = Shaping(args.rate, per_link=not args.tbf, burst=args.burst, ports=ports,
                          loss=args.loss)  # fmt: skip
    full = command(args.argv, shaping, args.stats)
    os.execvp(full[0], full)


if __name__ == "__main__":
    main()
