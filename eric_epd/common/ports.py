"""Ports for a process that binds them later: below the kernel's ephemeral range, and held in TIME_WAIT so that no
other pick takes the same one before its server binds it."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOW, HIGH = 18000, 21999
"""Where picks come from: under the ephemeral range (32768 up by default), clear of SGLang's own picks (22000 to
29999) and of Mooncake's transfer-engine RPC ports (15000 to 17000)."""
ATTEMPTS = 64


def ephemeral_low() -> int:
    """The first port the kernel hands out to bind(0) and connect() (32768 when the range cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reserve(port: int, host: str = "127.0.0.1") -> bool:
    """False if `port` is taken (a bind without SO_REUSEADDR fails: a listener, a connection, another pick's
    reservation). Otherwise listen on it with SO_REUSEADDR, connect and close the accepted side first: the port
    stays in TIME_WAIT (about a minute), where a bind without SO_REUSEADDR fails (the next pick, SGLang's probes) and
    a server binding with it (uvicorn, asyncio, ZMQ, torch's TCPStore) succeeds."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its TIME_WAIT lets reusing binds in
        listener.bind((host, port))
        listener.listen(1)
        client = stack.enter_context(socket.create_connection((host, port)))
        accepted, _ = listener.accept()
        accepted.close()  # the side that closes first holds TIME_WAIT: this one, on `port`
        client.recv(1)
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port no listener holds and no other pick will get for about a minute, for a server that binds it later.
    Ports in the ephemeral range could be taken meanwhile by any connect() or bind(0) on the host (a bind that then
    fails with EADDRINUSE), so picks come from under it; where the range reaches down there, the kernel picks."""
    if ephemeral_low() > HIGH:
        for port in random.sample(range(LOW, HIGH + 1), ATTEMPTS):
            if reserve(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
