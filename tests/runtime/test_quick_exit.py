"""A spawned engine or worker ends at once when its entry point returns: status 0, its log lines flushed, the
interpreter's teardown (atexit handlers) skipped; an entry point that raises still ends the process with status 1."""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
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
