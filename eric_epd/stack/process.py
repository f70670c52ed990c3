"""A server subprocess in its own process group, optionally pinned to CPUs, started and stopped around a `with`
block; free ports and fresh keys for the launchers."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess in its own process group, started and stopped around a `with` block."""

    health_path = "/health"

    def __init__(self, cmd: list[str], port: int, log_path: Path | None = None,
                 startup_timeout_s: float = 180.0, env: dict[str, str] | None = None,
                 api_key: str | None = None, cpus: tuple[int, ...] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        """The key this server checks (None: no check); secrets go by environment, never on the command line."""
        self._cmd = cmd
        self._env = env or {}
        self.cpus = cpus
        """The CPUs the process (and everything it starts) is pinned to; None: unpinned."""
        self._log_path = log_path
        self._timeout = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self):
        log = open(self._log_path, "wb") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        pin = functools.partial(os.sched_setaffinity, 0, self.cpus) if self.cpus else None
        self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **self._env}, preexec_fn=pin)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self._cmd[2:4]} exited with code {self.proc.returncode}; log: {self._log_path}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self._cmd[2:4]} not healthy after {self._timeout}s; log: {self._log_path}")

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

    @property
    def headers(self) -> dict[str, str]:
        """What a caller sends to pass this server's key check."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def new_key() -> str:
    """A fresh API key, for launchers given none."""
    return secrets.token_urlsafe(24)


