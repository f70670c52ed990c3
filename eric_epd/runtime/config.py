"""The settings every server on the shared skeleton has (model, parallelism, device, CPUs, batches, timeouts and the
ipc addresses between its processes); Eric's and Geri's own configs extend it."""

from __future__ import annotations

import dataclasses
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

from eric_epd.common.cpus import available_cpus, split_cpus
from eric_epd.common.heap import DEFAULT_KEEP_BYTES, check_keep_bytes
from eric_epd.common.proxies import parse_trusted_proxies

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class BatchLimits:
    """Bounds on one engine batch and on the engine queue."""

    max_items: int = 32
    """Most items in one batch."""
    max_patches: int = 0
    """Most cost units in one batch (Eric: vision patches before merging; Geri: image tokens, i.e. packed latent
    patches); a single larger item still runs alone. 0: by device (see RuntimeConfig.batch_limits)."""
    max_queued_items: int = 512
    """Items accepted but not finished; beyond this the router answers 503 with Retry-After."""
    in_flight: int = 0
    """Batches handed to the workers at once. 2: batch N+1 is broadcast while batch N computes, so the workers
    start it the moment N ends (and on CUDA copy its inputs to the device during N's forward). 0: by device, 2 on
    CUDA, 1 on CPU (where the engine and the workers share the same few cores, overlap buys nothing)."""

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_patches < 0 or self.max_queued_items < 1 or not 0 <= self.in_flight <= 2:
            raise ValueError("batch limits must be positive (max_patches 0: by device; in_flight 0, 1 or 2)")


@dataclass(frozen=True)
class RuntimeConfig:
    """What the router, the engine and the workers of one server need; frozen, validated without I/O."""

    POOL_PREFIX: ClassVar[str] = "eric-pool"
    CPU_MAX_BATCH_PATCHES: ClassVar[int] = 4096
    """Eric on CPU: a batch of several large images measured 10-15% slower than one at a time (their activations
    leave the caches) while small images still batch by the dozen."""
    CUDA_MAX_BATCH_PATCHES: ClassVar[int] = 32768

    model: Path
    tp_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    """"auto" picks cuda when available, else cpu."""
    host: str = "127.0.0.1"
    port: int = 8100
    batch: BatchLimits = field(default_factory=BatchLimits)
    cpus: tuple[int, ...] = ()
    """CPUs this server may use (router, engine and workers; the workers split them, one slice per rank, torch
    sized to its slice); () = every CPU the process may use. Give an engine on the same host the other CPUs."""
    request_timeout_s: float = 300.0
    """An accepted request that has no result after this long fails with 504."""
    worker_timeout_s: float = 120.0
    """A batch that takes longer than this marks the workers unhealthy."""
    liveness_timeout_s: float = 30.0
    """The engine renews its heartbeat every 0.1 s while its loop runs and its workers live, a batch in flight or
    not; silent this long, /health calls the server dead (a long batch only makes it busy)."""
    api_key: str | None = None
    """Callers of the protected HTTP routes must send 'Authorization: Bearer KEY'."""
    trusted_proxies: tuple[str, ...] = ()
    """Networks (--trusted-proxies) whose X-Forwarded-For/-Proto headers are believed; () = none (the peer is always
    the connecting address)."""
    run_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / f"eric-{uuid.uuid4().hex[:16]}")
    """Directory for the ipc sockets between the processes of this server; the server makes it (private) at start
    and removes it on the way out (a config alone creates nothing)."""
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    """New at every start: names the shared-memory pool (and NIXL agent), so consumers detect a restart."""
    heap_keep_bytes: int = DEFAULT_KEEP_BYTES
    """Freed memory each malloc arena of each process keeps for reuse (common/heap.py); 0 leaves glibc's defaults."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        check_keep_bytes(self.heap_keep_bytes)
        if any(c < 0 for c in self.cpus):
            raise ValueError("cpus must be CPU numbers")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        object.__setattr__(self, "trusted_proxies", parse_trusted_proxies(self.trusted_proxies))

    @property
    def pool_name(self) -> str:
        """The shared-memory segment rank 0 writes each item's output into."""
        return f"{self.POOL_PREFIX}-{self.instance_id}"

    @property
    def engine_input_addr(self) -> str:
        """The engine's ZMQ ipc address for requests from the router."""
        return f"ipc://{self.run_dir}/engine-in.sock"

    @property
    def engine_output_addr(self) -> str:
        """The engine's ZMQ ipc address for results and status sent back to the router."""
        return f"ipc://{self.run_dir}/engine-out.sock"

    @property
    def worker_result_addr(self) -> str:
        """The ZMQ ipc address the workers send their ready and result messages to."""
        return f"ipc://{self.run_dir}/worker-out.sock"

    @property
    def broadcast_wake_addr(self) -> str:
        """Where the engine pings idle workers that a batch is waiting in the shm broadcast."""
        return f"ipc://{self.run_dir}/broadcast-wake.sock"

    def resolved_device(self) -> str:
        """The configured device, with "auto" made "cuda" when CUDA is available and "cpu" otherwise."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def rank_device(self, rank: int, device_count: int) -> str:
        """Tensor-parallel rank `rank`'s device: "cpu", or its own CUDA device; more ranks than visible devices is
        an error naming both numbers (ranks never share a device)."""
        if self.resolved_device() != "cuda":
            return "cpu"
        if device_count < self.tp_size:
            raise ValueError(
                f"--tp {self.tp_size} needs {self.tp_size} CUDA devices, {device_count} visible "
                "(CUDA_VISIBLE_DEVICES); lower --tp or expose more devices"
            )
        return f"cuda:{rank}"

    def batch_limits(self) -> BatchLimits:
        """`batch` with max_patches and in_flight resolved for the device."""
        cpu = self.resolved_device() == "cpu"
        patches = self.batch.max_patches or (self.CPU_MAX_BATCH_PATCHES if cpu else self.CUDA_MAX_BATCH_PATCHES)
        return dataclasses.replace(self.batch, max_patches=patches, in_flight=self.batch.in_flight or (1 if cpu else 2))

    def own_cpus(self) -> tuple[int, ...]:
        """`cpus`, or every CPU this process may use."""
        return self.cpus or available_cpus()

    def worker_cpus(self, rank: int) -> tuple[int, ...]:
        """The slice of this server's CPUs that tensor-parallel rank `rank` runs on."""
        return split_cpus(self.own_cpus(), self.tp_size)[rank]

    def replace(self, **changes: object) -> Self:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)
