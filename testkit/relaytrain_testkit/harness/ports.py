"""A free TCP port on loopback."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now: the kernel picked it for a socket
    that is closed again. A server started on it soon after gets it; a client that connects
    to it finds nobody there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port
