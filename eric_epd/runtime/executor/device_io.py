"""A worker's host<->device traffic: a batch's inputs onto the device, rank 0's outputs into the router's pool.

On CPU both are plain copies. On CUDA the inputs go through two alternating pinned staging buffers with one
non-blocking copy on a stream of their own (so the next batch's copy overlaps this batch's forward) and the dtype
cast (of float32 inputs; uint8 levels stay so) on the device, and rank 0 copies each item's rows from the device
straight into the pool, which is registered as pinned memory (other ranks bring nothing back)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from eric_epd.runtime.executor.messages import ExecuteBatchMsg

logger = logging.getLogger(__name__)


class DeviceIO:
    """One per worker. `pool` is rank 0's view of the embedding pool (None on other ranks)."""

    def __init__(self, device: torch.device, pool: np.ndarray | None) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._pool = torch.from_numpy(pool) if pool is not None and pool.size else None
        self._staging: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # when each staging buffer's copy finished
        self._turn = 0
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._registered = False
        if self._cuda and self._pool is not None:
            self._registered = _host_register(self._pool)

    def inputs(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The batch's flat inputs (views on the broadcast, all of one dtype) as one tensor on the device: float32
        inputs cast to `dtype`, uint8 levels left as they are (the runner converts them on the device)."""
        if not parts:
            return torch.empty(0, dtype=dtype, device=self.device)
        sent = parts[0].dtype
        if any(p.dtype != sent for p in parts):
            raise ValueError(f"a batch mixes input dtypes: {sorted({str(p.dtype) for p in parts})}")
        if not sent.is_floating_point:
            dtype = sent
        if not self._cuda:
            return torch.cat(parts).to(dtype)
        n = sum(p.numel() for p in parts)
        turn, self._turn = self._turn, 1 - self._turn
        staging = self._staging_for(turn, n * sent.itemsize).view(sent)
        torch.cat(parts, out=staging)
        assert self._copy_stream is not None
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            on_device = staging.to(self.device, non_blocking=True)
            done = self._copied[turn] = torch.cuda.Event()
            done.record(self._copy_stream)
        main.wait_event(done)
        on_device.record_stream(main)  # allocated on the copy stream, used on the main one
        return on_device.to(dtype)  # cast on the device, not on the host

    @property
    def overlaps(self) -> bool:
        """Whether the next batch's inputs can be copied while a forward runs (CUDA)."""
        return self._cuda

    def sync(self) -> None:
        """Wait until the device finished the work queued so far (no-op on CPU)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def write(self, outputs: list[torch.Tensor], msg: ExecuteBatchMsg) -> float:
        """Rank 0: each item's output into the pool region reserved for it; the seconds taken. An output whose size
        differs from its region fails the batch before anything is written."""
        if self._pool is None:
            raise RuntimeError("this rank has no pool to write to")
        start = time.perf_counter()
        if len(outputs) != len(msg.items):
            raise ValueError(f"{len(outputs)} outputs for {len(msg.items)} items")
        flats = [_bytes_of(out) for out in outputs]
        for item, flat in zip(msg.items, flats):
            if flat.numel() != item.out_nbytes:
                raise ValueError(f"item {item.key}: output of {flat.numel()} bytes, {item.out_nbytes} reserved")
        for item, flat in zip(msg.items, flats):
            region = self._pool[item.out_offset : item.out_offset + item.out_nbytes]
            region.copy_(flat, non_blocking=self._registered)
        self.sync()
        return time.perf_counter() - start

    def close(self) -> None:
        """Unregister the pool's pinned host memory from CUDA, if this rank registered it."""
        if self._registered and self._pool is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pool.data_ptr())
            self._registered = False

    def _staging_for(self, turn: int, n: int) -> torch.Tensor:
        """Pinned byte buffer `turn` (of two) with room for n bytes, grown (never shrunk) as batches need; the copy
        that last read it has finished before it is written again."""
        done = self._copied[turn]
        if done is not None:
            done.synchronize()
        buffer = self._staging[turn]
        if buffer is None or buffer.numel() < n:
            buffer = self._staging[turn] = torch.empty(max(n, 1 << 22), dtype=torch.uint8, pin_memory=True)
        return buffer[:n]


def _bytes_of(out: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (contiguous first)."""
    out = out.contiguous()
    return out.view(torch.uint8).reshape(-1) if out.numel() else torch.empty(0, dtype=torch.uint8, device=out.device)


def _host_register(pool: torch.Tensor) -> bool:
    """Page-lock the pool so device-to-host copies land in it directly; False (pageable copies) if refused."""
    err = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
    code = getattr(err, "value", err)
    if code != 0:
        logger.warning(
            "cudaHostRegister of the %d-byte pool failed (%s): rank 0 copies output through pageable memory",
            pool.numel(),
            err,
        )
        return False
    logger.info("pool of %d bytes registered as pinned memory for device-to-pool copies", pool.numel())
    return True
