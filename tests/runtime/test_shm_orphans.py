"""Segments a server killed outright leaves in /dev/shm are swept, and nobody else's: real processes killed by
SIGKILL, a real Eric's pool, ring and run directory."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import textwrap
from pathlib import Path

from eric_epd.common.shm import SHM_DIR
from eric_epd.common.shm_orphans import sweep_orphans
from eric_epd.runtime import run_dir
from eric_epd.runtime.executor.shm_broadcast import BROADCAST_PREFIX
from eric_epd.stack.servers import EricServer
from tests.support.holders import holder, killed

OWNER = textwrap.dedent(
    """
    import sys, time
    from multiprocessing.shared_memory import SharedMemory
    from eric_epd.common.shm import Segment
    kind, name = sys.argv[1], sys.argv[2]
    segment = (Segment if kind == "locked" else SharedMemory)(name=name, create=True, size=4096)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def owner(kind: str, name: str) -> subprocess.Popen:
    """A process that creates segment `name` (`kind` "locked": as our servers do; "plain": with no lock, as an
    older release did) and holds it until killed."""
    return holder(OWNER, kind, name)


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def test_a_dead_creators_segment_is_swept_a_live_ones_and_a_young_ones_are_not() -> None:
    prefix = f"test-orphan-{secrets.token_hex(4)}-"
    dead, live, plain = (f"{prefix}{n}" for n in ("dead", "live", "plain"))
    procs = [owner("locked", dead), owner("locked", live), owner("plain", plain)]
    try:
        killed(procs[0])
        assert exists(dead), "SIGKILL left the segment behind (what the sweep is for)"
        assert sweep_orphans((prefix,)) == []  # all younger than ORPHAN_AGE_S: left alone
        assert sweep_orphans((prefix,), min_age_s=0) == [dead]
        assert not exists(dead) and exists(live) and exists(plain)  # a live creator's lock; a live mapping
        killed(procs[2])
        assert sweep_orphans((prefix,), min_age_s=0) == [plain]  # unlocked and no longer mapped by anyone
        assert sweep_orphans(("test-orphan-none-",), min_age_s=0) == []  # other prefixes are never looked at
    finally:
        for proc in procs:
            if proc.poll() is None:
                killed(proc)
        for name in (dead, live, plain):
            if exists(name):
                os.unlink(os.path.join(SHM_DIR, name))


def test_an_eric_killed_outright_leaves_nothing_after_the_next_sweep(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """A live Eric's pool, ring and run directory survive a sweep; SIGKILL of its whole group leaves them; the
    sweeps each server runs at start remove them."""
    prefixes, tmp = ("eric-pool-", BROADCAST_PREFIX), Path(tempfile.gettempdir())
    before, dirs_before = set(os.listdir(SHM_DIR)), set(os.listdir(tmp))
    eric = EricServer(qwen2_vl_tiny, log_path=tmp_path / "eric.log")
    with eric:
        ours = {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith(prefixes)}
        assert any(n.startswith("eric-pool-") for n in ours) and any(n.startswith(BROADCAST_PREFIX) for n in ours)
        [its_dir] = [n for n in set(os.listdir(tmp)) - dirs_before if run_dir.NAME.fullmatch(n)]
        assert not set(sweep_orphans(prefixes, min_age_s=0)) & ours  # alive: its router and engine hold them
        assert its_dir not in run_dir.sweep(min_age_s=0)  # alive: its router holds the lock
        eric.kill()
        assert ours <= set(os.listdir(SHM_DIR)), "SIGKILL of the group left the segments (what the sweep is for)"
        assert (tmp / its_dir / "engine-in.sock").exists(), "SIGKILL left its ipc sockets"
        assert ours <= set(sweep_orphans(prefixes, min_age_s=0))
        assert its_dir in run_dir.sweep(min_age_s=0)
        assert not ours & set(os.listdir(SHM_DIR)) and not (tmp / its_dir).exists()
