"""Typed descriptions of where an embedding lives, one per backend; returned by /v1/encode, used by consumers.

These cross hosts (JSON over HTTP), so they are plain msgspec Structs: no pickle, no code.
"""

from __future__ import annotations

import msgspec


class ShmLocation(msgspec.Struct, frozen=True):
    """Same host only: the pool is a POSIX shared-memory segment; read `nbytes` at `offset`."""

    name: str
    offset: int
    host_id: str
    """Boot id of the producer's host; a consumer on another host must not use this handle."""


class MooncakeLocation(msgspec.Struct, frozen=True):
    """Mooncake TransferEngine: read `nbytes` from `addr` of the engine at `session_id` (host:rpc_port)."""

    session_id: str
    addr: int
    protocol: str


class NixlLocation(msgspec.Struct, frozen=True):
    """NIXL: read `nbytes` from `addr` (DRAM) of agent `agent`; its metadata is at `metadata_url`."""

    agent: str
    addr: int
    metadata_url: str


class EmbeddingHandle(msgspec.Struct, frozen=True, omit_defaults=True):
    """One embedding held by one Eric; every location gives the same bytes until it is acknowledged."""

    hash: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: str
    """Base URL of the Eric that holds it (control API: ack, metadata, HTTP fallback)."""
    instance_id: str
    """Changes whenever that Eric restarts; an ack with a stale instance id fails."""
    http: str
    """URL of GET /v1/embeddings/{hash}: the universal fallback."""
    shm: ShmLocation | None = None
    mooncake: MooncakeLocation | None = None
    nixl: NixlLocation | None = None
    generation: int = 0
    """Identifies this pool entry (informational: the lease token already names one lease of one entry)."""
    lease: str = ""
    """The lease token: a capability that alone reads this entry over HTTP, adds child leases and acknowledges.
    Sent as the X-Eric-Lease header. The one-sided planes (shm, NIXL, Mooncake) cannot check it."""


LEASE_HEADER = "X-Eric-Lease"
"""HTTP header carrying a lease token on Eric's embedding routes."""

BACKENDS = ("shm", "nixl", "mooncake", "http")
"""Consumer preference order: fastest first."""
