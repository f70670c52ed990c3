"""Shared by the orphan-sweep tests: a real process that takes something (a segment, a run directory) and holds it
until it is killed outright, as a server killed by SIGKILL or the OOM killer is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])


def holder(script: str, *args: str) -> subprocess.Popen:
    """`python -c script args` in a session of its own, once it has printed "ready" (it took what it holds)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def killed(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole group (its resource tracker too: nothing cleans up after it)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
