"""A launched server that dies or never answers its health check fails with the end of its log in the error (CI keeps
no log files), and is stopped; one started on wide CPUs (start_cpus) is pinned to its own, every thread, once
healthy; a None in its env unsets that variable; SIGINT stops it even when its parent ignores SIGINT; a private_tmp
one takes its temporary files along."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from eric_epd.common.ports import free_port
from eric_epd.stack.process import ServerProcess

DIES = "import sys; print('\\n'.join(f'line {i}' for i in range(100))); print('port in use', flush=True); sys.exit(3)"


def test_a_server_that_exits_shows_its_logs_last_lines(tmp_path: Path) -> None:
    server = ServerProcess([sys.executable, "-c", DIES], free_port(), tmp_path / "dies.log", startup_timeout_s=30)
    with pytest.raises(RuntimeError) as failed:
        server.start()
    message = str(failed.value)
    assert "exited with code 3" in message and message.endswith("port in use")
    assert "line 99" in message and "line 1\n" not in message  # the tail only, not the whole log


def test_a_server_that_never_answers_is_stopped_and_shows_its_log(tmp_path: Path) -> None:
    hangs = "import time; print('still loading', flush=True); time.sleep(600)"
    server = ServerProcess([sys.executable, "-c", hangs], free_port(), tmp_path / "hangs.log", startup_timeout_s=3)
    with pytest.raises(TimeoutError) as failed:
        server.start()
    assert "--- log tail ---\nstill loading" in str(failed.value) and server.proc is None  # stopped


class _Listing(ServerProcess):
    """`python -m http.server`: its directory listing at / is the health check."""

    health_path = "/"


def test_a_server_started_on_wide_cpus_is_pinned_to_its_own_once_healthy(tmp_path: Path) -> None:
    every = tuple(sorted(os.sched_getaffinity(0)))
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = _Listing(cmd, port, tmp_path / "http.log", cpus=every[:1], start_cpus=every)
    server.launch()
    assert server.proc is not None
    assert os.sched_getaffinity(server.proc.pid) == set(every)  # starting: anywhere
    try:
        server.wait_ready()
        tasks = os.listdir(f"/proc/{server.proc.pid}/task")
        assert tasks and all(os.sched_getaffinity(int(t)) == set(every[:1]) for t in tasks)
    finally:
        server.stop()


def test_a_none_in_env_removes_that_variable_from_the_servers_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ERIC_TEST_INHERITED", "from the parent")
    monkeypatch.setenv("ERIC_TEST_KEPT", "kept")
    show = "import os; print(repr(os.environ.get('ERIC_TEST_INHERITED')), os.environ['ERIC_TEST_KEPT'], flush=True)"
    env: dict[str, str | None] = {"ERIC_TEST_INHERITED": None}
    server = ServerProcess([sys.executable, "-c", show], free_port(), tmp_path / "env.log", 30, env)
    with pytest.raises(RuntimeError) as failed:  # it prints and exits: the log tail is in the error
        server.start()
    assert str(failed.value).endswith("None kept")
    server = ServerProcess([sys.executable, "-c", show], free_port(), tmp_path / "env2.log", 30, {})
    with pytest.raises(RuntimeError) as failed:  # negative control: without the None it is inherited
        server.start()
    assert str(failed.value).endswith("'from the parent' kept")


def test_a_server_launched_with_sigint_ignored_still_stops_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = _Listing(cmd, port, tmp_path / "http.log")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a shell's background job, which children inherit
    try:
        server.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    proc = server.proc
    assert proc is not None
    server.stop()
    # http.server's own exit on KeyboardInterrupt, not the SIGKILL (-9) that follows an ignored SIGINT
    assert proc.returncode == 0 and "Keyboard interrupt received" in (tmp_path / "http.log").read_text()


class _PrivateTmp(_Listing):
    private_tmp = True


def test_a_private_tmp_server_leaves_nothing_in_tmp_once_stopped(tmp_path: Path) -> None:
    port = free_port()
    leaves = (
        "import http.server, os, tempfile; open(os.path.join(tempfile.gettempdir(), 'left-behind'), 'w').close(); "
        f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')"
    )
    server = _PrivateTmp([sys.executable, "-c", leaves], port, tmp_path / "tmp.log")
    with server:
        tmpdir = server._tmpdir
        assert tmpdir is not None and os.path.dirname(tmpdir) == tempfile.gettempdir()
        assert os.listdir(tmpdir) == ["left-behind"]  # what it writes to "/tmp" lands in its own directory
    assert not os.path.exists(tmpdir)  # and goes with it
