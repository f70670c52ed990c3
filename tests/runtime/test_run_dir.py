"""A server's run directory (its ipc sockets) is claimed under a lock and swept once its server is dead: real
processes killed by SIGKILL; a live server's, a young one, an unlocked one and one named otherwise stay."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from eric_epd.runtime import run_dir
from tests.support.holders import holder, killed

CLAIMER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from eric_epd.runtime import run_dir
    run_dir.claim(Path(sys.argv[1]))
    print("ready", flush=True)
    time.sleep(600)
    """
)


def claimed(path: Path) -> subprocess.Popen:
    """A process that claims `path` as its run directory and lives until killed."""
    return holder(CLAIMER, str(path))


def test_a_dead_servers_directory_is_swept_and_nobody_elses(tmp_path: Path) -> None:
    dead, live = tmp_path / "eric-00000000000000de", tmp_path / "eric-0000000000000011"
    unlocked, other = tmp_path / "eric-000000000000beef", tmp_path / "eric-mine"
    procs = [claimed(dead), claimed(live), claimed(other)]
    unlocked.mkdir()
    try:
        killed(procs[0])
        killed(procs[2])
        (dead / "engine-in.sock").touch()
        assert run_dir.sweep(tmp_path) == []  # younger than ORPHAN_AGE_S: its server may be starting
        assert run_dir.sweep(tmp_path, min_age_s=0) == [dead.name]
        assert not dead.exists()
        assert live.exists() and unlocked.exists() and other.exists()  # a live lock; no lock; not our name
    finally:
        for proc in procs:
            if proc.poll() is None:
                killed(proc)
    assert run_dir.sweep(tmp_path, min_age_s=0) == [live.name]  # once its server is dead
