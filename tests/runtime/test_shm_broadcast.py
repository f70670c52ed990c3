"""eric_epd.runtime.executor.shm_broadcast round trips: random messages and tensors, bit for bit, through real reader
processes (spawn), and the zero-copy tensor helpers; CPU only."""

from __future__ import annotations

import zlib

import msgspec
import numpy as np
import pytest

from eric_epd.runtime.executor.shm_broadcast import BroadcastAborted, BroadcastHandle, ShmBroadcast
from eric_epd.runtime.executor.tensor_views import buffer_to_tensor, tensor_to_buffer
from tests.support import helpers_shm
from tests.support.helpers_shm import CTX
from tests.support.helpers_shm import any_dead as _any_dead
from tests.support.helpers_shm import segments as _segments
from tests.support.helpers_shm import start as _start

# every test here checks that no segment leaked; `procs` reaps the reader processes a test starts
no_leaked_segments, procs = helpers_shm.no_leaked_segments, helpers_shm.procs

N_MSGS, SLOT = 200, 1 << 20
SPILL_AT = {3, 57, 58, 121, 199}  # messages with one buffer larger than the slot


def _message(i: int) -> tuple[bytes, list]:
    """Deterministic message i: 0-4 buffers of assorted types/sizes (incl. empty), header with CRCs."""
    rng = np.random.default_rng(i)
    bufs: list = []
    for j in range(int(rng.integers(0, 5))):
        r = rng.random()
        size = 0 if r < 0.2 else int(rng.integers(1, 4096)) if r < 0.7 else int(rng.integers(4096, 300_000))
        raw = rng.integers(0, 256, size, dtype=np.uint8)
        bufs.append([raw, raw.tobytes(), memoryview(raw), raw[: size // 4 * 4].view(np.float32), raw[::2]][j])
    if i in SPILL_AT:
        bufs.append(rng.integers(0, 256, int(rng.integers(SLOT + 1, 3 * SLOT)), dtype=np.uint8))
    flat = [np.ascontiguousarray(np.asarray(memoryview(b))).tobytes() for b in bufs]
    meta = {"i": i, "lens": [len(f) for f in flat], "crc": [zlib.crc32(f) for f in flat]}
    return msgspec.msgpack.encode(meta), bufs


def _check(i: int, header: bytes, bufs: list) -> str | None:
    meta = msgspec.msgpack.decode(header)
    got = {"i": i, "lens": [len(b) for b in bufs], "crc": [zlib.crc32(b) for b in bufs]}
    return None if meta == got else f"message {i}: expected {meta}, got {got}"


def _reader_main(handle_raw: bytes, rank: int, n_msgs: int, mode: str, out, busy_s: float = 1.0) -> None:
    reader = ShmBroadcast.attach(msgspec.msgpack.decode(handle_raw, type=BroadcastHandle), rank, busy_s=busy_s)
    ok, errors = 0, []
    try:
        for i in range(n_msgs):
            if mode == "copy":
                header, bufs = reader.dequeue_copy(timeout=20)
                err = _check(i, header, bufs)
            elif mode == "ctx":
                with reader.receive(timeout=20) as (header, views):
                    err = _check(i, header, views)
            else:
                header, views = reader.dequeue(timeout=20)
                err = _check(i, header, views)
                reader.release()
            ok += err is None
            errors += [err] if err else []
    except Exception as e:
        errors.append(repr(e))
    finally:
        reader.close()
    out.put((rank, ok, errors))


@pytest.mark.parametrize("busy_s", [1.0, 0.0], ids=["polling", "blocking-on-pings"])
def test_three_readers_200_random_messages(procs, busy_s):
    """busy_s=0: every wait of every reader blocks on the writer's pings (stale ones included) instead of polling."""
    writer = ShmBroadcast.create(3, n_slots=4, slot_bytes=SLOT)
    q = CTX.Queue()
    for rank, mode in enumerate(("views", "ctx", "copy")):
        _start(procs, _reader_main, msgspec.msgpack.encode(writer.handle()), rank, N_MSGS, mode, q, busy_s)
    try:
        for i in range(N_MSGS):
            header, bufs = _message(i)
            writer.enqueue(header, bufs, timeout=20, should_abort=_any_dead(procs))
        results = sorted(q.get(timeout=30) for _ in procs)
        assert len(_segments()) <= 1 + writer.n_slots  # main + at most one spill per slot, never more
    except BroadcastAborted:
        pytest.fail(f"a reader exited early: {[q.get(timeout=5) for p in procs if not p.is_alive()]}")
    finally:
        writer.close()
    assert results == [(rank, N_MSGS, []) for rank in range(3)]
    assert writer.n_spilled == len(SPILL_AT)


def _tensors(seed: int, small_only: bool):
    import torch

    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38, -1.5])
    out = [
        special,
        special.to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.empty(0, 16, dtype=torch.bfloat16),
        torch.randn(64, 48, generator=g).to(torch.bfloat16).t(),
        torch.randn(3, 224, 224, generator=g),  # float32 pixels, 588 KiB
    ]
    if not small_only:  # bfloat16 activations (1.1 MiB) + 4 MiB: the message spills
        out += [torch.randn(577, 1024, generator=g).bfloat16(), torch.randn(2 << 20, generator=g).bfloat16()]
    return out


def _tensor_reader_main(handle: BroadcastHandle, rank: int, n_msgs: int, out) -> None:
    import torch

    reader = ShmBroadcast.attach(handle, rank)
    errors = []
    for _ in range(n_msgs):
        with reader.receive(timeout=30) as (header, views):
            meta = msgspec.msgpack.decode(header)
            want = _tensors(meta["seed"], meta["small_only"])
            for k, (view, (dtype, shape), w) in enumerate(zip(views, meta["specs"], want, strict=True)):
                t = buffer_to_tensor(view, dtype, shape)
                same = (
                    t.dtype == w.dtype
                    and t.shape == w.shape
                    and torch.equal(t.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8))
                )
                zero_copy = t.numel() == 0 or t.data_ptr() == np.frombuffer(view, np.uint8).ctypes.data
                if not (same and zero_copy):
                    errors.append(f"seed {meta['seed']} tensor {k}: {dtype}{shape} {same=} {zero_copy=}")
    reader.close()
    out.put((rank, errors))


def test_tensors_round_trip_bitwise(procs):
    writer = ShmBroadcast.create(2, n_slots=2, slot_bytes=2 << 20)
    q, plan = CTX.Queue(), [(seed, seed % 2 == 1) for seed in range(4)]
    for rank in range(2):
        _start(procs, _tensor_reader_main, writer.handle(), rank, len(plan), q)
    try:
        for seed, small_only in plan:
            ts = _tensors(seed, small_only)
            specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in ts]
            header = msgspec.msgpack.encode({"seed": seed, "small_only": small_only, "specs": specs})
            writer.enqueue(header, ts, timeout=30, should_abort=_any_dead(procs))
        assert sorted(q.get(timeout=30) for _ in procs) == [(0, []), (1, [])]
        assert writer.n_spilled == 2
    finally:
        writer.close()


def test_tensor_helpers_zero_copy():
    import torch

    for t in (torch.randn(4, 5), torch.randn(3, 7).bfloat16(), torch.tensor(1.25, dtype=torch.bfloat16)):
        buf = tensor_to_buffer(t)
        assert buf.nbytes == t.numel() * t.element_size()
        for dtype in (t.dtype, str(t.dtype), str(t.dtype).removeprefix("torch.")):
            back = buffer_to_tensor(buf, dtype, t.shape)
            assert back.dtype == t.dtype and back.shape == t.shape and back.data_ptr() == t.data_ptr()
            assert torch.equal(back.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
    nc = torch.randn(6, 4).to(torch.bfloat16).t()
    assert torch.equal(buffer_to_tensor(tensor_to_buffer(nc), "bfloat16", nc.shape), nc)
    empty = buffer_to_tensor(tensor_to_buffer(torch.empty(0, 3)), "float32", (0, 3))
    assert empty.shape == (0, 3) and empty.dtype == torch.float32
    with pytest.raises((ValueError, RuntimeError)):
        buffer_to_tensor(b"\0" * 6, "float32", (2,))
