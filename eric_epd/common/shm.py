"""POSIX shared-memory segments that outlive exported views and that attaching processes never unlink."""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

_tracker_lock = threading.Lock()  # guards the brief process-wide patch in attach_untracked


class Segment(SharedMemory):
    """SharedMemory without a lingering fd whose close() leaves the mapping to any live export (tensor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_fd", -1) >= 0:  # POSIX: only close() uses it; the mapping stays valid
            os.close(self._fd)
            self._fd = -1

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
