"""The settings of the transfer layer's producer side: the embedding pool and the backends that serve it."""

from __future__ import annotations

from dataclasses import dataclass

TRANSFER_BACKENDS = ("shm", "mooncake", "nixl")


@dataclass(frozen=True)
class TransferConfig:
    """The embedding pool and the backends that serve it (HTTP is always on)."""

    pool_bytes: int = 512 * 2**20
    """Size of the preallocated shared-memory pool holding finished embeddings."""
    ttl_s: float = 300.0
    """An entry not acknowledged within this long (since its last lease) is freed."""
    pool_wait_s: float = 10.0
    """How long new work waits for pool space before answering 503."""
    keep_acked_bytes: int = 0
    """Acknowledged embeddings kept as a content cache (evicted first, LRU) up to this many bytes, so repeated
    images are not encoded again; 0 frees them at the last acknowledgement."""
    backends: tuple[str, ...] = ("shm",)
    advertise_host: str = "127.0.0.1"
    """Host name consumers use to reach this Eric (HTTP control API, Mooncake, NIXL)."""
    mooncake_protocol: str = "tcp"
    """"tcp" or "rdma"."""
    mooncake_device: str = ""
    """RDMA device names for Mooncake (empty: auto)."""

    def __post_init__(self) -> None:
        unknown = set(self.backends) - set(TRANSFER_BACKENDS)
        if unknown:
            raise ValueError(f"unknown transfer backends {sorted(unknown)}; choose from {TRANSFER_BACKENDS}")
        if self.pool_bytes < 4096 or self.ttl_s <= 0 or self.pool_wait_s < 0:
            raise ValueError("pool_bytes must be >= 4096, ttl_s > 0, pool_wait_s >= 0")
