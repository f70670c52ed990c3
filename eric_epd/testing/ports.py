"""Ports for tests: a URL that refuses every connection for as long as the test holds it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refusing_url() -> Iterator[str]:
    """An http URL on a port bound but never listened on: connects to it are refused at once, and no other process
    can take the port meanwhile (a port that was merely free when chosen can be taken by a server started later,
    which then accepts the connection and never answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
