"""A server's private directory of ipc sockets: claimed under a lock for the server's life, and swept at the next
start on the host when its server was killed outright (SIGKILL, the OOM killer) and left it behind."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from eric_epd.common.shm_orphans import remove_unowned

logger = logging.getLogger(__name__)

NAME = re.compile(r"eric-[0-9a-f]{16}")
"""RuntimeConfig.run_dir's default name; only these are swept, never a directory a user named."""
LOCK = "owner.lock"
ORPHAN_AGE_S = 60.0
"""A directory whose lock is younger than this is never swept (its server may be starting)."""


def claim(run_dir: Path) -> int:
    """Make `run_dir` (private) and hold a shared flock on its owner lock until the returned fd is closed or this
    process dies (however: the kernel drops the lock with the process)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: contended by nobody but a sweeper
        os.utime(fd)  # young again: a directory reused by name is not a sweeper's any more
    except OSError:
        os.close(fd)
        raise
    return fd


def sweep(parent: Path | None = None, min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove the run directories under `parent` (the temp directory) named like RuntimeConfig's default, owned by
    this user, whose owner lock is older than `min_age_s` and held by no live process; returns their names. A
    directory without a lock (an older release's) is left alone: nothing says whether its server lives."""
    parent = parent or Path(tempfile.gettempdir())
    now, uid, swept = time.time(), os.getuid(), []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        if not NAME.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and _removed(Path(entry.path), now - min_age_s):
            swept.append(entry.name)
    if swept:
        logger.warning("removed %d run directories left by dead servers: %s", len(swept), ", ".join(swept))
    return swept


def _removed(run_dir: Path, born_before: float) -> bool:
    """Remove `run_dir` if its lock was made before `born_before` and nobody holds it; whether it did."""
    return remove_unowned(str(run_dir / LOCK), lambda: shutil.rmtree(run_dir), born_before)
