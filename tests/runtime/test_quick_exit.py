"""A spawned engine or worker ends at once when its entry point returns: status 0, its log lines flushed, the
interpreter's teardown (atexit handlers) skipped, a daemonic child left running terminated; an entry point that raises
still ends the process with status 1."""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

from eric_epd.runtime.quick_exit import then_exit


def _entry(log: str, marker: str, fail: bool) -> None:
    logging.basicConfig(filename=log, level=logging.INFO, format="%(message)s")
    atexit.register(Path(marker).write_text, "the interpreter's teardown ran")
    logging.getLogger("entry").info("entry point done")
    if fail:
        raise RuntimeError("entry point failed")


def _run(tmp_path: Path, fail: bool) -> tuple[int | None, str, bool]:
    log, marker = tmp_path / "entry.log", tmp_path / "atexit-ran"
    proc = mp.get_context("spawn").Process(target=then_exit, args=(_entry, str(log), str(marker), fail))
    proc.start()
    proc.join(60)
    return proc.exitcode, log.read_text(), marker.exists()


def test_a_returning_entry_point_exits_0_with_its_log_flushed_and_no_teardown(tmp_path: Path) -> None:
    code, log, teardown = _run(tmp_path, fail=False)
    assert (code, log, teardown) == (0, "entry point done\n", False)


def test_a_raising_entry_point_still_exits_1_through_the_teardown(tmp_path: Path) -> None:
    code, log, teardown = _run(tmp_path, fail=True)
    assert (code, log, teardown) == (1, "entry point done\n", True)


def _leave_a_child(pid_file: str) -> None:
    child = mp.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    child.start()
    Path(pid_file).write_text(str(child.pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_daemonic_child_left_running_is_terminated(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    proc = mp.get_context("spawn").Process(target=then_exit, args=(_leave_a_child, str(pid_file)))
    proc.start()
    proc.join(60)
    child = int(pid_file.read_text())
    try:
        assert proc.exitcode == 0
        assert not _alive(child)  # terminated and reaped by its parent, not orphaned
    finally:
        if _alive(child):
            os.kill(child, 9)
