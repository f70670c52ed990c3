"""Port picks for servers that bind later: distinct, under the ephemeral range, refused to other picks until the
server binds, and bindable by a server that sets SO_REUSEADDR."""

from __future__ import annotations

import socket

from eric_epd.common.ports import HIGH, LOW, ephemeral_low, free_port, reserve


def _bind(port: int, reuse: bool) -> socket.socket:
    s = socket.socket()
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_picks_are_distinct_and_under_the_ephemeral_range():
    picks = [free_port() for _ in range(100)]
    assert len(set(picks)) == 100
    if ephemeral_low() > HIGH:  # Linux's default range (32768 up); a host whose range reaches lower gets bind(0)
        assert all(LOW <= p <= HIGH for p in picks)


def test_a_picked_port_refuses_plain_binds_and_takes_a_reusing_server():
    port = free_port()
    assert not reserve(port)  # the next pick, or SGLang's probe, skips it
    try:
        _bind(port, reuse=False).close()
        raise AssertionError("a bind without SO_REUSEADDR got a reserved port")
    except OSError:
        pass
    with _bind(port, reuse=True) as server:  # uvicorn, asyncio, ZMQ and torch's TCPStore set it
        assert server.getsockname()[1] == port


def test_a_port_with_a_listener_is_never_picked():
    with _bind(0, reuse=True) as held:
        assert not reserve(held.getsockname()[1])
    with socket.socket() as probe:  # negative control: a port nobody holds is reserved
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert reserve(free)
