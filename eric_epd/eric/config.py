"""The one typed configuration of an Eric server (the shared runtime settings plus its own), parsed once in the
parent and handed to every child process."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from eric_epd.eric.sglang.video import SglangVideo
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import UrlPolicy
from eric_epd.models.compute_dtype import COMPUTE_DTYPES
from eric_epd.runtime.config import DTYPES, BatchLimits, RuntimeConfig
from eric_epd.transfer.config import TransferConfig

__all__ = ["COMPILE_MODES", "COMPUTE_DTYPES", "DTYPES", "SGLANG_DTYPES", "BatchLimits", "EricConfig", "SglangConfig"]

SGLANG_DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE_MODES = ("none", "inductor")
"""How the workers run the vision tower (`eric-epd serve --compile`): eagerly, or through torch.compile's inductor
(models/layers/compiled.py)."""


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr.strip(), strict=False)
    except ValueError as e:
        raise ValueError(f"SGLang allowed peer {cidr!r} is not a CIDR such as 10.0.0.0/24: {e}") from None


@dataclass(frozen=True)
class SglangConfig:
    """SGLang's encoder-server protocol on Eric (eric/sglang): on by default, answers beside the native API."""

    enabled: bool = True
    register_urls: tuple[str, ...] = ()
    """SGLang EncoderBootstrapServer URLs this Eric registers with (for prefills started without --encoder-urls)."""
    send_timeout_s: float = 180.0
    """How long a finished part waits for its ranks (SGLang's SGLANG_ENCODER_SEND_TIMEOUT)."""
    req_timeout_s: float = 180.0
    """How long a rank's early call waits for the part's /encode (SGLang's SGLANG_ENCODER_REQ_TIMEOUT)."""
    register_retry_s: float = 5.0
    register_attempts: int = 30
    max_parts: int = 4096
    """Most parts (req_ids) held at once; a new req_id past it gets 503 until parts are delivered or released idle
    (after send_timeout_s, or req_timeout_s before their /encode)."""
    max_receivers: int = 1024
    """Most cached ZMQ sockets to scheduler ranks; the least recently used idle one is closed to make room (503
    when every one is busy)."""
    receiver_idle_s: float = 300.0
    """A cached receiver socket unused this long is closed."""
    video: SglangVideo = field(default_factory=SglangVideo)
    """How SGLang's own encoder samples and first resizes a Qwen-VL video (the prefills' --mm-process-config):
    videos asked for on SGLang's protocol are prepared so, under their own content hashes."""
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
        init=False, repr=False, compare=False
    )
    """allowed_peers parsed (set by __post_init__; a bad CIDR fails at start)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_networks", tuple(_network(cidr) for cidr in self.allowed_peers))
        if self.dtype not in SGLANG_DTYPES:
            raise ValueError(f"SGLang dtype must be one of {SGLANG_DTYPES}, got {self.dtype!r}")
        if self.send_timeout_s <= 0 or self.req_timeout_s <= 0 or self.register_retry_s < 0:
            raise ValueError("SGLang timeouts must be positive")
        if self.register_attempts < 1:
            raise ValueError("register_attempts must be >= 1")
        if self.max_parts < 1 or self.max_receivers < 1 or self.receiver_idle_s <= 0:
            raise ValueError("max_parts and max_receivers must be >= 1, receiver_idle_s > 0")


@dataclass(frozen=True)
class EricConfig(RuntimeConfig):
    """Everything one Eric server needs: the shared runtime settings plus media, transfer and SGLang's protocol."""

    media: MediaLimits = field(default_factory=MediaLimits)
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    preprocess_threads: int = 0
    """Media decode + preprocessing threads in the router; 0 = one per CPU of `cpus`, at most 4."""
    max_body_bytes: int = 32 * 2**20
    """Largest accepted /v1/encode body (base64 media counts)."""
    max_items_per_request: int = 64
    alias_entries: int = 4096
    """Most raw-bytes aliases kept (eric/alias.py: fetched bytes and settings -> content hash, least recently used
    dropped): a resent item whose embedding is still in the pool is answered without decoding; 0 turns it off."""
    transfer: TransferConfig = field(default_factory=lambda: TransferConfig())
    sglang: SglangConfig = field(default_factory=lambda: SglangConfig())
    global_cache: str | None = None
    """host:port of the Mooncake Store master whose store this Eric shares finished embeddings through (None: off)."""
    global_cache_bytes: int = 256 * 2**20
    """Memory this Eric contributes to the store (the store evicts beyond what its members contribute)."""
    register_with: tuple[str, ...] = ()
    """Gateways this Eric joins by itself (POST /admin/encoders with register_key), heartbeats and leaves."""
    register_key: str | None = None
    """The gateways' admin key (--register-key, or $EPD_GATEWAY_ADMIN_KEY)."""
    heartbeat_s: float = 2.0
    drain_timeout_s: float = 10.0
    """On shutdown, how long requests in flight may take to finish (new connections are refused meanwhile)."""
    compile: str = "none"
    """How the workers run the vision tower (`COMPILE_MODES`): "none" eagerly; "inductor" through torch.compile
    (the Qwen towers' parts around attention, compiled by each worker before it is ready; CUDA graphs on CUDA)."""
    compute_dtype: str = "auto"
    """The dtype the tower computes in (`COMPUTE_DTYPES`); its rows are cast to `dtype` (the rows sent) as they leave
    the worker's runner. "auto": `dtype`, except float32 on a CPU without units for a half-precision `dtype`
    (models/compute_dtype.py; each worker logs its choice and why)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preprocess_threads < 0 or self.alias_entries < 0:
            raise ValueError("preprocess_threads and alias_entries must be >= 0")
        if self.heartbeat_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("heartbeat_s must be > 0 and drain_timeout_s >= 0")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")

    @property
    def public_url(self) -> str:
        """The URL other hosts reach this Eric at: its transfer advertise host and HTTP port."""
        return f"http://{self.transfer.advertise_host}:{self.port}"

    def preprocess_pool_size(self) -> int:
        """Threads decoding and preprocessing media: `preprocess_threads`, or up to 4 of this Eric's own CPUs."""
        return self.preprocess_threads or min(4, len(self.own_cpus()))
