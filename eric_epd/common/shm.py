"""POSIX shared-memory segments that outlive exported views and that attaching processes never unlink; their creator
holds a lock on each for its life, so a segment left by a creator killed outright is found and swept (shm_orphans)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

_tracker_lock = threading.Lock()  # guards the brief process-wide patch in attach_untracked


SHM_DIR = "/dev/shm"
"""Where Linux keeps POSIX shared-memory segments, one file per name."""


class Segment(SharedMemory):
    """SharedMemory without a lingering fd whose close() leaves the mapping to any live export (tensor). Its creator
    holds a shared flock on its file until it unlinks it or dies (however: the kernel drops the lock with the
    process), which is how `sweep_orphans` tells a live owner's segment from a dead one's."""

    _owner_fd = -1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_fd", -1) >= 0:  # POSIX: only close() uses it; the mapping stays valid
            if kwargs.get("create"):
                self._owner_fd = _hold(self.name)
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the name (the creator's call) and let go of the owner's lock."""
        super().unlink()
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1

    def close(self) -> None:
        """Unmap the segment, or leave the mapping alone while an exported view (tensor) still uses it."""
        try:  # not contextlib.suppress: this also runs from __del__ at interpreter shutdown
            super().close()
        except BufferError:
            return

    __del__ = close


def attach_untracked(name: str) -> Segment:
    """Map an existing segment without registering it with the resource_tracker (see below)."""
    # Attaching registers the name (Python < 3.13 has no track=False). Spawned children share the
    # parent's tracker, so unregistering afterwards drops the creator's own registration (KeyError noise
    # at unlink), and staying registered lets the tracker unlink / warn at exit. So never register.
    if sys.version_info >= (3, 13):
        return Segment(name=name, track=False)
    with _tracker_lock:  # register is patched process-wide for the duration of the attach
        orig, resource_tracker.register = resource_tracker.register, lambda *args: None
        try:
            return Segment(name=name)
        finally:
            resource_tracker.register = orig


def _hold(name: str) -> int:
    """A close-on-exec fd on segment `name`'s file under a shared flock (-1 where segments are not files there)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return -1
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: never contended by anyone but a sweeper
    return fd
