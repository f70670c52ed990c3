"""The broadcast ring's memory layout (see ShmBroadcast in shm_broadcast.py): header and control-block word offsets,
the segment's geometry, and the memory fence that orders payload accesses against the flags that publish them."""

from __future__ import annotations

import threading

MAGIC = 0x3130434243495245  # b"ERICBC01" little-endian
ALIGN, PAGE = 64, 4096
G_CLOSED = 4  # int64 words of the global header: magic, n_readers, n_slots, slot_bytes, closed
C_SEQ, C_LEN, C_NAME_LEN, C_READ = 0, 1, 2, 16  # int64 words of a slot control block
NAME_OFF, MAX_NAME = 64, 40  # spill name bytes in a control block; "<name>_<seq>" must fit 64 B


# Memory fence. Payload stores must be visible before the seq store that publishes them, and a reader's
# payload loads must be done before the read[r] store that hands the slot back. x86-64 (TSO) never
# reorders store->store or load->load nor lets a store pass an earlier load: there the fence only stops
# compiler / interpreter reordering. AArch64 may reorder all of these; as vLLM's shm_broadcast does, a
# lock acquire + release (atomic read-modify-writes with acquire/release semantics) sits between payload
# accesses and the flag store. Flags are aligned int64 words, accessed single-copy atomically (numpy
# item access is one 8-byte access) on both, and hold growing sequence numbers compared for equality:
# a stale value means "not yet", never "ready".
_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Order the accesses before it against those after it (see above)."""
    with _fence_lock:
        pass


def align(n: int, a: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `a`."""
    return (n + a - 1) // a * a


def geometry(n_readers: int, n_slots: int, slot_bytes: int) -> tuple[int, int, int, int]:
    """-> (ctrl_stride, data_off, slot_stride, segment size) in bytes; see ShmBroadcast."""
    ctrl = align(C_READ * 8 + 8 * n_readers)
    data_off, slot_stride = align(64 + n_slots * ctrl, PAGE), align(slot_bytes, PAGE)
    return ctrl, data_off, slot_stride, data_off + n_slots * slot_stride
