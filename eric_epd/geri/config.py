"""The one typed configuration of a Geri server: the shared runtime settings plus its limits and output pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from eric_epd.geri.limits import GeriLimits
from eric_epd.runtime.config import BatchLimits, RuntimeConfig


@dataclass(frozen=True)
class GeriConfig(RuntimeConfig):
    """Everything one Geri server needs; frozen, validated without I/O. Batch cost counts image tokens."""

    POOL_PREFIX: ClassVar[str] = "geri-pool"
    CPU_MAX_BATCH_PATCHES: ClassVar[int] = 4096
    CUDA_MAX_BATCH_PATCHES: ClassVar[int] = 65536

    port: int = 8200
    batch: BatchLimits = field(default_factory=lambda: BatchLimits(max_items=8, max_queued_items=64))
    limits: GeriLimits = field(default_factory=GeriLimits)
    pool_bytes: int = 256 * 2**20
    """Shared memory the workers write finished images into (uint8 RGB) until the router has read them."""
    max_body_bytes: int = 64 * 2**20
    """Largest accepted /v1/generate body (base64 safetensors counts)."""
    producer_urls: tuple[str, ...] = ()
    """Producers (Erics, or anything serving Eric's embedding API) whose handles Geri reads; none: inline only."""
    producer_api_key: str | None = None
    """Sent to those producers (--producer-api-key, or $ERIC_API_KEY)."""
    transfer_backends: tuple[str, ...] = ("shm", "nixl", "mooncake", "http")
    """Backends Geri may read handles over, best first."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pool_bytes < 4096 or self.max_body_bytes < 1024:
            raise ValueError("pool_bytes must be >= 4096 and max_body_bytes >= 1024")
