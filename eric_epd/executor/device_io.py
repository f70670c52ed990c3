"""A worker's host<->device traffic: a batch's pixels onto the device, rank 0's output into the embedding pool.

On CPU both are plain copies. On CUDA the pixels go through a reusable pinned staging buffer with one non-blocking
copy and the dtype cast on the device, and rank 0 copies each item's rows from the device straight into the pool,
which is registered as pinned memory (other ranks bring nothing back)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from eric_epd.executor.messages import ExecuteBatchMsg

logger = logging.getLogger(__name__)


class DeviceIO:
    """One per worker. `pool` is rank 0's view of the embedding pool (None on other ranks)."""

    def __init__(self, device: torch.device, pool: np.ndarray | None) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._pool = torch.from_numpy(pool) if pool is not None and pool.size else None
        self._staging: torch.Tensor | None = None
        self._registered = False
        if self._cuda and self._pool is not None:
            self._registered = _host_register(self._pool)

    def pixels(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The batch's float32 pixel rows (views on the broadcast) as one tensor on the device, in `dtype`."""
        if not parts:
            return torch.empty(0, dtype=dtype, device=self.device)
        if not self._cuda:
            return torch.cat(parts).to(dtype)
        n = sum(p.numel() for p in parts)
        staging = self._staging_for(n)
        torch.cat(parts, out=staging)
        return staging.to(self.device, non_blocking=True).to(dtype)  # cast on the device, not on the host

    def sync(self) -> None:
        """Wait until the device finished the work queued so far (no-op on CPU)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def write(self, out: torch.Tensor, msg: ExecuteBatchMsg) -> float:
        """Rank 0: each item's rows of the batch output into the pool region reserved for it; the seconds taken."""
        if self._pool is None:
            raise RuntimeError("this rank has no pool to write to")
        start = time.perf_counter()
        out = out.contiguous()
        flat = out.view(torch.uint8).reshape(-1) if out.numel() else torch.empty(0, dtype=torch.uint8)
        if flat.numel() != sum(i.out_nbytes for i in msg.items):
            raise ValueError(f"output of {flat.numel()} bytes does not fill the {len(msg.items)} reserved regions")
        offset = 0
        for item in msg.items:
            region = self._pool[item.out_offset: item.out_offset + item.out_nbytes]
            region.copy_(flat[offset: offset + item.out_nbytes], non_blocking=self._registered)
            offset += item.out_nbytes
        self.sync()
        return time.perf_counter() - start

    def close(self) -> None:
        if self._registered and self._pool is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pool.data_ptr())
            self._registered = False

    def _staging_for(self, n: int) -> torch.Tensor:
        """A pinned float32 buffer of n values; grown (never shrunk) as batches need. Reused only after the previous
        batch was synchronized (the worker syncs after every forward), so no copy from it is still in flight."""
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(max(n, 1 << 20), dtype=torch.float32, pin_memory=True)
        return self._staging[:n]


def _host_register(pool: torch.Tensor) -> bool:
    """Page-lock the pool so device-to-host copies land in it directly; False (pageable copies) if refused."""
    err = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
    code = getattr(err, "value", err)
    if code != 0:
        logger.warning("cudaHostRegister of the %d-byte pool failed (%s): rank 0 copies output through pageable "
                       "memory", pool.numel(), err)
        return False
    logger.info("pool of %d bytes registered as pinned memory for device-to-pool copies", pool.numel())
    return True
