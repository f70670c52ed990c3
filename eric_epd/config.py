"""The one typed configuration of an Eric server, parsed once in the parent and handed to every child process."""

from __future__ import annotations

import dataclasses
import ipaddress
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from eric_epd.common.cpus import available_cpus, split_cpus
from eric_epd.server.media import MediaLimits, UrlPolicy

DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_MAX_BATCH_PATCHES = 4096
CUDA_MAX_BATCH_PATCHES = 32768


@dataclass(frozen=True)
class BatchLimits:
    """Bounds on one engine batch and on the engine queue."""

    max_items: int = 32
    """Most media items in one batch."""
    max_patches: int = 0
    """Most vision patches (before merging) in one batch; a single larger item still runs alone. 0: by device
    (EricConfig.batch_limits): 4096 on CPU, where a batch of several large images measured 10-15% slower than one
    at a time (their activations leave the caches) while small images still batch by the dozen; 32768 on CUDA."""
    max_queued_items: int = 512
    """Items accepted but not finished; beyond this the router answers 503 with Retry-After."""
    in_flight: int = 0
    """Batches handed to the workers at once. 2: batch N+1 is broadcast while batch N computes, so the workers
    start it the moment N ends (and on CUDA copy its pixels to the device during N's forward). 0: by device, 2 on
    CUDA, 1 on CPU (where the engine and the workers share the same few cores, overlap buys nothing)."""

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_patches < 0 or self.max_queued_items < 1 or not 0 <= self.in_flight <= 2:
            raise ValueError("batch limits must be positive (max_patches 0: by device; in_flight 0, 1 or 2)")


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


SGLANG_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr.strip(), strict=False)
    except ValueError as e:
        raise ValueError(f"SGLang allowed peer {cidr!r} is not a CIDR such as 10.0.0.0/24: {e}") from None


@dataclass(frozen=True)
class SglangConfig:
    """SGLang's encoder-server protocol on Eric (plugins/sglang): on by default, answers beside the native API."""

    enabled: bool = True
    register_urls: tuple[str, ...] = ()
    """SGLang EncoderBootstrapServer URLs this Eric registers with (for prefills started without --encoder-urls)."""
    send_timeout_s: float = 180.0
    """How long a finished part waits for its ranks (SGLang's SGLANG_ENCODER_SEND_TIMEOUT)."""
    req_timeout_s: float = 180.0
    """How long a rank's early call waits for the part's /encode (SGLang's SGLANG_ENCODER_REQ_TIMEOUT)."""
    register_retry_s: float = 5.0
    register_attempts: int = 30
    dtype: str = "auto"
    """dtype of the rows sent: must be the prefill's model dtype, since Mooncake/NIXL landing buffers are read in
    it. "auto" applies SGLang's own --dtype auto rule to the checkpoint (float32 -> float16)."""
    mooncake_protocol: str = "rdma"
    """Transport of Eric's Mooncake push engine: SGLang's own (its MOONCAKE_PROTOCOL, default rdma); Mooncake picks
    the transport from the target, so both sides must agree. Without RDMA devices Mooncake falls back to TCP."""
    allowed_peers: tuple[str, ...] = ()
    """CIDRs (e.g. 10.0.0.0/24) Eric may push parts to besides the address a request came from; SGLang's receivers
    send no key, so where Eric connects is bounded by this and by the caller's own address."""
    peer_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(
        init=False, repr=False, compare=False)
    """allowed_peers parsed (set by __post_init__; a bad CIDR fails at start)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_networks", tuple(_network(cidr) for cidr in self.allowed_peers))
        if self.dtype not in SGLANG_DTYPES:
            raise ValueError(f"SGLang dtype must be one of {SGLANG_DTYPES}, got {self.dtype!r}")
        if self.send_timeout_s <= 0 or self.req_timeout_s <= 0 or self.register_retry_s < 0:
            raise ValueError("SGLang timeouts must be positive")
        if self.register_attempts < 1:
            raise ValueError("register_attempts must be >= 1")


@dataclass(frozen=True)
class EricConfig:
    """Everything one Eric server needs; frozen, validated without I/O."""

    model: Path
    tp_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    """"auto" picks cuda when available, else cpu."""
    host: str = "127.0.0.1"
    port: int = 8100
    batch: BatchLimits = field(default_factory=BatchLimits)
    media: MediaLimits = field(default_factory=MediaLimits)
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    cpus: tuple[int, ...] = ()
    """CPUs this Eric may use (router, engine and workers; the workers split them, one slice per rank, torch sized to
    its slice); () = every CPU the process may use. Give an engine on the same host the other CPUs."""
    preprocess_threads: int = 0
    """Media decode + preprocessing threads in the router; 0 = one per CPU of `cpus`, at most 4."""
    max_body_bytes: int = 32 * 2**20
    """Largest accepted /v1/encode body (base64 media counts)."""
    max_items_per_request: int = 64
    request_timeout_s: float = 300.0
    """An accepted request that has no result after this long fails with 504."""
    worker_timeout_s: float = 120.0
    """A batch that takes longer than this marks the workers unhealthy."""
    api_key: str | None = None
    """Callers of every HTTP route but /health, /metrics and SGLang's protocol must send 'Authorization: Bearer
    KEY' (--api-key, or the ERIC_API_KEY environment variable)."""
    transfer: TransferConfig = field(default_factory=lambda: TransferConfig())
    sglang: SglangConfig = field(default_factory=lambda: SglangConfig())
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="eric-")))
    """Directory for the ipc sockets between the processes of this server."""
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    """New at every start: names the pool and NIXL agent, and lets consumers detect a restarted producer."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if any(c < 0 for c in self.cpus) or self.preprocess_threads < 0:
            raise ValueError("cpus must be CPU numbers and preprocess_threads >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def pool_name(self) -> str:
        return f"eric-pool-{self.instance_id}"

    @property
    def public_url(self) -> str:
        return f"http://{self.transfer.advertise_host}:{self.port}"

    @property
    def engine_input_addr(self) -> str:
        return f"ipc://{self.run_dir}/engine-in.sock"

    @property
    def engine_output_addr(self) -> str:
        return f"ipc://{self.run_dir}/engine-out.sock"

    @property
    def worker_result_addr(self) -> str:
        return f"ipc://{self.run_dir}/worker-out.sock"

    def resolved_device(self) -> str:
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
            raise ValueError(f"--tp {self.tp_size} needs {self.tp_size} CUDA devices, {device_count} visible "
                             "(CUDA_VISIBLE_DEVICES); lower --tp or expose more devices")
        return f"cuda:{rank}"

    def batch_limits(self) -> BatchLimits:
        """`batch` with max_patches and in_flight resolved for the device."""
        cpu = self.resolved_device() == "cpu"
        patches = self.batch.max_patches or (CPU_MAX_BATCH_PATCHES if cpu else CUDA_MAX_BATCH_PATCHES)
        return dataclasses.replace(self.batch, max_patches=patches, in_flight=self.batch.in_flight or (1 if cpu else 2))

    def own_cpus(self) -> tuple[int, ...]:
        """`cpus`, or every CPU this process may use."""
        return self.cpus or available_cpus()

    def worker_cpus(self, rank: int) -> tuple[int, ...]:
        """The slice of this Eric's CPUs that tensor-parallel rank `rank` runs on."""
        return split_cpus(self.own_cpus(), self.tp_size)[rank]

    def preprocess_pool_size(self) -> int:
        return self.preprocess_threads or min(4, len(self.own_cpus()))

    def replace(self, **changes: object) -> EricConfig:
        return dataclasses.replace(self, **changes)


