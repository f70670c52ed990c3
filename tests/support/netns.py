"""A host on the "internet" for tests: a network namespace the test creates (ip netns, a veth pair) holding a global
address, with a one-file HTTP server in it; and a loopback listener that counts who reached it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

PUBLIC_ADDRESS = "1.2.3.4"
"""A global unicast address, routed to the namespace only while the test runs (the machine has no other route)."""

REDIRECTOR = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
target = sys.argv[1]
class Redirect(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(302)
        self.send_header("Location", target)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer((sys.argv[2], 80), Redirect).serve_forever()
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def public_redirector(target: str) -> Iterator[str]:
    """http://PUBLIC_ADDRESS/, answering every GET with a 302 to `target`, from a namespace of its own."""
    tag = f"{os.getpid() % 100000}"
    ns, host_end, ns_end = f"epd-origin-{tag}", f"epdh{tag}", f"epdn{tag}"
    _ip("netns", "add", ns)
    server = None
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("addr", "add", "10.233.0.1/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("route", "add", f"{PUBLIC_ADDRESS}/32", "dev", host_end)
        for args in (
            ("addr", "add", f"{PUBLIC_ADDRESS}/32", "dev", ns_end),
            ("link", "set", ns_end, "up"),
            ("link", "set", "lo", "up"),
            ("route", "add", "10.233.0.1/32", "dev", ns_end),
            ("route", "add", "default", "via", "10.233.0.1"),
        ):
            _ip("netns", "exec", ns, "ip", *args)
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", REDIRECTOR, target, PUBLIC_ADDRESS])
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection((PUBLIC_ADDRESS, 80), timeout=1):
                break
            assert server.poll() is None and time.monotonic() < deadline, "the namespaced origin did not start"
            time.sleep(0.1)
        yield f"http://{PUBLIC_ADDRESS}"
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class LoopbackListener:
    """A TCP listener on 127.0.0.1 that accepts, counts and closes every connection."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        """Stop listening."""
        self._sock.close()
