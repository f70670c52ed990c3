"""Typed descriptions of where an embedding lives, one per backend; returned by /v1/encode, used by consumers.

These cross hosts (JSON over HTTP), so they are plain msgspec Structs: no pickle, no code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from urllib.parse import urlsplit

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


class ProducerInfo(msgspec.Struct, frozen=True):
    """GET /v1/transfer: a producer's pool (its statistics, and its own locations of pool offset 0, one per backend
    it serves). Consumers check every handle's locations against these before reading (check_locations)."""

    instance_id: str
    pool_name: str
    pool_bytes: int
    used_bytes: int = 0
    entries: int = 0
    cached_bytes: int = 0
    backends: list[str] = msgspec.field(default_factory=list)
    shm: ShmLocation | None = None
    mooncake: MooncakeLocation | None = None
    nixl: NixlLocation | None = None


class AckBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """POST /v1/embeddings/{hash}/ack, the lease in the X-Eric-Lease header: the instance the lease was taken from,
    whether this repeats an attempt whose answer was lost, and whether a child lease takes the acknowledged one's
    place (`keep`: the consumer proved its read, yet may read again)."""

    instance_id: str | None = None
    retry: bool = False
    keep: bool = False


class AckAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer to an acknowledgement: its status and, when `keep` was asked and the lease could still add one, the
    child lease's token (it lapses at the TTL like any lease, or ends with an ack of its own)."""

    status: str
    lease: str | None = None


LEASE_HEADER = "X-Eric-Lease"
"""HTTP header carrying a lease token on Eric's embedding routes."""


class AckRequest(msgspec.Struct, frozen=True):
    """The one way a lease is given back: POST `url` with `headers` and `content` (every client builds it here)."""

    url: str
    headers: dict[str, str]
    content: bytes


def ack_request(
    producer: str, content_hash: str, lease: str, instance_id: str | None, retry: bool = False, keep: bool = False
) -> AckRequest:
    """The POST that ends the lease `lease` on `content_hash` at the Eric `producer` (instance `instance_id`);
    `retry`: it repeats an attempt whose answer was lost; `keep`: a child lease is answered in its place."""
    return AckRequest(
        f"{producer.rstrip('/')}/v1/embeddings/{content_hash}/ack",
        {LEASE_HEADER: lease},
        msgspec.json.encode(AckBody(instance_id, retry=retry, keep=keep)),
    )


BACKENDS = ("shm", "nixl", "mooncake", "http")
"""Consumer preference order: fastest first."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_CONTENT_HASH = re.compile(r"^[0-9a-f]{64}$")


def is_content_hash(identifier: str) -> bool:
    """Eric's content hash: 64 lowercase hex digits."""
    return bool(_CONTENT_HASH.match(identifier))


class HandleError(ValueError):
    """An offered handle that a consumer must not use: the request fails, the consumer does not."""


def check_handle(h: EmbeddingHandle, eric_urls: Collection[str], width: int | Collection[int]) -> None:
    """The handle points only at a configured producer, and describes a [rows, width] tensor of its byte length;
    `width` may be the set of the model's widths (Qwen3-Omni's vision and audio rows differ): the consumer then
    checks each item's width against its modality's."""
    if h.producer not in eric_urls:
        raise HandleError(
            f"embedding {h.hash[:16]} is held by {h.producer!r}, which is not one of the "
            f"configured producers {list(eric_urls)}"
        )
    if not h.lease:
        raise HandleError(f"embedding {h.hash[:16]} has no lease token")
    widths = {width} if isinstance(width, int) else set(width)
    if h.dtype not in DTYPE_BYTES or len(h.shape) != 2 or h.shape[0] < 1 or h.shape[1] not in widths:
        wanted = " or ".join(str(w) for w in sorted(widths))
        raise HandleError(
            f"embedding {h.hash[:16]} is {list(h.shape)} {h.dtype}; this model takes [rows, {wanted}] "
            f"in one of {sorted(DTYPE_BYTES)}"
        )
    if h.nbytes != math.prod(h.shape) * DTYPE_BYTES[h.dtype]:
        raise HandleError(f"embedding {h.hash[:16]}: {h.nbytes} bytes do not fit {list(h.shape)} {h.dtype}")
    offsets = [h.shm.offset if h.shm is not None else 0, *(loc.addr for loc in (h.mooncake, h.nixl) if loc)]
    if min(offsets) < 0:
        raise HandleError(f"embedding {h.hash[:16]}: a negative offset or address")
    host = urlsplit(h.producer).hostname
    if h.http != f"{h.producer}/v1/embeddings/{h.hash}":
        raise HandleError(f"embedding {h.hash[:16]}: HTTP location {h.http!r} is not its producer's")
    if h.nixl is not None and not h.nixl.metadata_url.startswith(f"{h.producer}/"):
        raise HandleError(f"embedding {h.hash[:16]}: NIXL metadata {h.nixl.metadata_url!r} is not its producer's")
    if h.mooncake is not None and h.mooncake.session_id.rsplit(":", 1)[0] != host:
        raise HandleError(
            f"embedding {h.hash[:16]}: Mooncake session {h.mooncake.session_id!r} is not on its producer's host {host}"
        )


def _within(what: str, h: EmbeddingHandle, start: int, base: int, size: int) -> None:
    if start < base or start + h.nbytes > base + size:
        raise HandleError(
            f"embedding {h.hash[:16]}: {what} range [{start}, {start + h.nbytes}) is outside the "
            f"producer's pool [{base}, {base + size})"
        )


def check_locations(h: EmbeddingHandle, own: ProducerInfo) -> None:
    """Every location the handle offers is one its producer serves (`own`, from the producer itself): the same shm
    segment and host, Mooncake session (host and port) and NIXL agent, and a byte range inside the pool. HandleError
    names the first that is not; nothing is read then."""
    if h.instance_id != own.instance_id:
        raise HandleError(
            f"embedding {h.hash[:16]}: instance {h.instance_id!r} is not {h.producer}'s ({own.instance_id!r})"
        )
    if h.nbytes < 0:
        raise HandleError(f"embedding {h.hash[:16]}: negative length {h.nbytes}")
    for name in ("shm", "mooncake", "nixl"):
        loc, mine = getattr(h, name), getattr(own, name)
        if loc is None:
            continue
        if mine is None:
            raise HandleError(f"embedding {h.hash[:16]}: {h.producer} serves no {name} location")
        if isinstance(loc, ShmLocation):
            if (loc.name, loc.host_id) != (mine.name, mine.host_id):
                raise HandleError(
                    f"embedding {h.hash[:16]}: shm segment {loc.name!r} is not {h.producer}'s pool {mine.name!r}"
                )
            _within("shm", h, loc.offset, 0, own.pool_bytes)
        elif isinstance(loc, MooncakeLocation):
            if (loc.session_id, loc.protocol) != (mine.session_id, mine.protocol):
                raise HandleError(
                    f"embedding {h.hash[:16]}: Mooncake session {loc.session_id!r} is not "
                    f"{h.producer}'s {mine.session_id!r}"
                )
            _within("Mooncake", h, loc.addr, mine.addr, own.pool_bytes)
        else:
            if (loc.agent, loc.metadata_url) != (mine.agent, mine.metadata_url):
                raise HandleError(
                    f"embedding {h.hash[:16]}: NIXL agent {loc.agent!r} is not {h.producer}'s {mine.agent!r}"
                )
            _within("NIXL", h, loc.addr, mine.addr, own.pool_bytes)
