"""Ports for a process that binds them later: below the kernel's ephemeral range (no connect() or bind(0) takes
them meanwhile), and held in TIME_WAIT for about a minute so that no other pick takes the same one first."""

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
    reservation). Otherwise listen on it, connect and close the accepted side first: the port stays in TIME_WAIT
    (about a minute), where a bind without SO_REUSEADDR fails (the next pick) and a server binding with it (uvicorn,
    asyncio, ZMQ, torch's TCPStore, vLLM's and Mooncake's servers) succeeds."""
    try:
        with contextlib.ExitStack() as stack:
            listener = stack.enter_context(socket.socket())
            listener.bind((host, port))  # without SO_REUSEADDR: the check itself, atomic against other picks
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # inherited by the accepted side's
            listener.listen(1)  # TIME_WAIT, which then lets reusing binds in
            client = stack.enter_context(socket.create_connection((host, port)))
            accepted, _ = listener.accept()
            accepted.close()  # the side that closes first holds TIME_WAIT: this one, on `port`
            client.recv(1)
    except OSError:
        return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port no listener holds and no other pick will get for about a minute, for a server that binds it later.
    Ports in the ephemeral range could be taken meanwhile by any connect() or bind(0) on the host (a bind that then
    fails with EADDRINUSE), so picks come from under it; where the range reaches down there, the kernel picks."""
    if ephemeral_low() > HIGH:
        for port in random.SystemRandom().sample(range(LOW, HIGH + 1), ATTEMPTS):
            if reserve(port, host):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
