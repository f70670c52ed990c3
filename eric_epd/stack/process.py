"""A server subprocess in its own process group, optionally pinned to CPUs, started and stopped around a `with`
block (several at once with overlapping start-ups); free ports and fresh keys for the launchers."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import httpx

from eric_epd.common.ports import free_port

__all__ = ["ServerProcess", "free_port", "new_key", "running", "start_all", "stop_all"]


def _in_child(cpus: tuple[int, ...] | None) -> None:
    """Before the server's exec: SIGINT back to its default (a shell's background job starts with it ignored, which
    Python then keeps: the server would ignore `stop`'s SIGINT and be killed only 20 s later, undrained) and the
    pinning to `cpus`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if cpus:
        os.sched_setaffinity(0, cpus)


class ServerProcess:
    """A server subprocess in its own process group, started and stopped around a `with` block."""

    health_path = "/health"
    hurry_s: float | None = None
    """At the end of a `with` block, how long it may drain before a second SIGINT cuts the drain short (None: as
    long as it takes, up to the SIGKILL)."""
    private_tmp = False
    """Whether the server gets a TMPDIR of its own, removed once it has stopped (what it leaves there, e.g. a killed
    vLLM's ZMQ ipc sockets, goes with it)."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        log_path: Path | None = None,
        startup_timeout_s: float = 180.0,
        env: dict[str, str | None] | None = None,
        api_key: str | None = None,
        cpus: tuple[int, ...] | None = None,
        start_cpus: tuple[int, ...] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        """The key this server checks (None: no check); secrets go by environment, never on the command line."""
        self._cmd = cmd
        self._env = env or {}
        """Added to the server's environment; a None value removes that variable."""
        self.cpus = cpus
        """The CPUs the process (and everything it starts) is pinned to; None: unpinned."""
        self.start_cpus = start_cpus
        """The CPUs it may use until healthy (None: `cpus`): a server whose start-up is serial (vLLM's three
        processes import one after another) then starts beside another pinned to the same `cpus`, not after it."""
        self._log_path = log_path
        self._timeout = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: str | None = None

    def start(self):
        """Launch and wait until healthy; returns self."""
        return self.launch().wait_ready()

    def launch(self):
        """Start the process without waiting for it (`wait_ready` does; `start_all` overlaps start-ups)."""
        log = open(self._log_path, "wb") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        cpus = self.start_cpus or self.cpus
        env = {**os.environ, **self._env}
        if self.private_tmp:
            self._tmpdir = env["TMPDIR"] = tempfile.mkdtemp(prefix="epd-server-")
        self.proc = subprocess.Popen(
            self._cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={k: v for k, v in env.items() if v is not None},  # None: unset
            preexec_fn=functools.partial(_in_child, cpus),
        )
        return self

    def wait_ready(self):
        """Wait until the launched process answers its health check (stopping it on a timeout); returns self."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self._cmd[2:4]} exited with code {self.proc.returncode}; log: {self._log_path}{self._log_tail()}"
                )
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    if self.start_cpus and self.cpus:
                        pin_group(self.proc.pid, self.cpus)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(
            f"{self._cmd[2:4]} not healthy after {self._timeout}s; log: {self._log_path}{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 25) -> str:
        """The end of the log, for a failure message (the log itself may be gone when the failure is read, in CI)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
            tail = log.read().decode(errors="replace").splitlines()[-lines:]
        return "\n--- log tail ---\n" + "\n".join(tail)

    def interrupt(self) -> None:
        """Ask the process to stop (SIGINT: graceful) without waiting; `stop` waits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL of the whole process group at once (a crash: nothing drains); idempotent."""
        self.stop(graceful=False)

    def stop(self, graceful: bool = True, hurry_s: float | None = None) -> None:
        """SIGINT (graceful: an Eric drains; with `hurry_s`, SIGINT again after that long: the drain is cut short),
        then SIGKILL of the whole process group; idempotent."""
        if self.proc is None:
            return
        if graceful:
            self.interrupt()
            try:
                if hurry_s is not None:
                    try:
                        self.proc.wait(hurry_s)
                    except subprocess.TimeoutExpired:
                        self.interrupt()
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def headers(self) -> dict[str, str]:
        """What a caller sends to pass this server's key check."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(hurry_s=self.hurry_s)


S = TypeVar("S", bound=ServerProcess)


def group_pids(pid: int) -> list[int]:
    """The processes in `pid`'s process group, as /proc lists them now (those that end meanwhile left out)."""
    group = os.getpgid(pid)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                if os.getpgid(int(entry)) == group:
                    found.append(int(entry))
    return found


def pin_group(pid: int, cpus: tuple[int, ...]) -> None:
    """Pin every thread of every process in `pid`'s process group to `cpus` (threads started later inherit it)."""
    for member in group_pids(pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            for task in os.listdir(f"/proc/{member}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), cpus)


def start_all(*servers: S) -> tuple[S, ...]:
    """Launch every server, then wait for each: their start-ups overlap. On a failure all of them are stopped."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
    except BaseException:
        stop_all(*servers)
        raise
    return servers


def stop_all(*servers: ServerProcess, hurry: bool = False) -> None:
    """Interrupt every server, then wait for each: their shutdowns overlap. With `hurry`, each drain is cut short
    after the server's own `hurry_s`, as at the end of its `with` block."""
    for server in servers:
        server.interrupt()
    for server in servers:
        server.stop(hurry_s=server.hurry_s if hurry else None)


@contextlib.contextmanager
def running(*servers: S, hurry: bool = False) -> Iterator[tuple[S, ...]]:
    """`with running(a, b) as (a, b):` both started together, and stopped together however the block ends (with
    `hurry`, each drain cut short after its `hurry_s`, as at the end of a server's own `with` block)."""
    start_all(*servers)
    try:
        yield servers
    finally:
        stop_all(*servers, hurry=hurry)


def new_key() -> str:
    """A fresh API key, for launchers given none."""
    return secrets.token_urlsafe(24)
