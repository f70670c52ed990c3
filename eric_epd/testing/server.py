"""Start a real Eric server as a subprocess (for tests, benchmarks and the demo) and wait until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EricServer:
    """`with EricServer(model, tp=2) as eric: httpx.post(eric.url + "/v1/encode", ...)`."""

    def __init__(self, model: Path, tp: int = 1, extra_args: tuple[str, ...] = (), port: int | None = None,
                 log_path: Path | None = None, startup_timeout_s: float = 180.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "eric_epd", "serve", "--model", str(model), "--tp", str(tp),
                     "--port", str(self.port), "--allowed-host", "127.0.0.1", *extra_args]
        self._log_path = log_path
        self._timeout = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EricServer:
        log = open(self._log_path, "wb") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Eric exited with code {self.proc.returncode}; log: {self._log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"Eric not healthy after {self._timeout}s; log: {self._log_path}")

    def stop(self) -> None:
        """SIGINT (graceful), then SIGKILL of the whole process group; idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> EricServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
