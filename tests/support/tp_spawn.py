"""Where the tests' spawned TP ranks meet (a file rendezvous in the test's own directory, as Eric's workers meet, so
no TCP port is picked, raced for or listened on), and how a rank that saved its results leaves."""

from __future__ import annotations

from pathlib import Path

from eric_epd.runtime.quick_exit import exit_now


def rendezvous(directory: str | Path) -> str:
    """torch.distributed's init_method for ranks spawned by one test: a file no other test shares (it must not
    exist yet; the last rank to leave removes it)."""
    path = Path(directory) / "tp-rendezvous"
    path.unlink(missing_ok=True)
    return f"file://{path}"


def leave_at_once() -> None:
    """End a spawned rank that has saved its results and left its process group, skipping the interpreter's teardown
    (os._exit(0)). Two full runs of tests/models here lost rank 1 of the Gemma 3 fixture to SIGABRT, "terminate
    called without an active exception" (a C++ thread destroyed while joinable), with no Python error; alone the
    fixture always passed. Whatever went wrong before the results were saved still fails the test: the rank raises,
    or its results file is missing."""
    exit_now()
