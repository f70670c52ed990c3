"""The gateway's one typed configuration, parsed once from the command line."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from epd_gateway.admission import Network, parse_network
from epd_gateway.embeds import EmbeddingShape
from eric_epd.common.dns import DnsTarget, parse_dns_target
from eric_epd.common.heap import DEFAULT_KEEP_BYTES, check_keep_bytes
from eric_epd.common.proxies import TRUSTED_PROXIES_HELP, parse_trusted_proxies
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import UrlPolicy
from eric_epd.wire.handoff import MAX_HANDLES


@dataclass(frozen=True)
class GatewayConfig:
    """Every gateway setting: the upstreams, routing, limits, keys and timeouts (see `parse_args` for each)."""

    encoder_urls: tuple[str, ...] = ()
    encoder_dns: tuple[DnsTarget, ...] = ()
    """--encoder-dns: names (e.g. Kubernetes headless Services) whose every address is an Eric at the given port,
    re-resolved every `dns_interval_s` (router/epd_gateway/dns_members.py)."""
    dns_interval_s: float = 2.0
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    colocated_urls: tuple[str, ...] = ()
    """Instances that prefill and decode themselves (no KV transfer)."""
    epd_prefill_urls: tuple[str, ...] = ()
    """SGLang only: `--language-only` prefills whose `--encoder-urls` are the Erics. SGLang's prefill dispatches the
    media to the encoders itself, so EPD requests go there unchanged; the rest go to --prefill-urls."""
    backend: str = "vllm"
    epd_min_items: int = 2
    """Requests with at least this many media items take the encoder path."""
    host: str = "127.0.0.1"
    port: int = 8000
    trusted_proxies: tuple[str, ...] = ()
    """--trusted-proxies: networks whose X-Forwarded-For/-Proto are believed (none: the headers are ignored)."""
    api_key: str | None = None
    """Clients' key. Never forwarded: upstreams get their own keys below."""
    admin_key: str | None = None
    """Key for /admin/encoders (--admin-key, or $EPD_GATEWAY_ADMIN_KEY)."""
    metrics_key: str | None = None
    """Key for /metrics (--metrics-key, or $EPD_GATEWAY_METRICS_KEY); the admin key also reads them."""
    register_from: tuple[Network, ...] = ()
    """--register-from: networks Erics may register from and at (none: registration is refused). Naming them is the
    operator's word that Erics there may be sent clients' media."""
    eric_api_key: str | None = None
    """Sent to the Erics (--eric-api-key, or $ERIC_API_KEY)."""
    upstream_api_key: str | None = None
    """Sent to vLLM/SGLang instead of the client's key (--upstream-api-key, or $VLLM_API_KEY)."""
    client_embeddings: EmbeddingShape | None = None
    """Set by --allow-client-embeddings MODEL_DIR: image/video embeds parts accepted (trusted callers only),
    checked against their grid and this shape; None refuses them."""
    max_body_bytes: int = 64 * 2**20
    max_items: int = 16
    max_image_requests: int = 64
    """Image generations in progress at most (each holds up to MAX_IMAGES + 2 upstream connections); past it a 503."""
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    """Bounds on the media the gateway fetches itself for the engines' own path (bytes, time, redirects)."""
    max_inline_bytes: int = 64 * 2**20
    """Most bytes of media the gateway fetches and inlines for one request, every part counted (413 beyond)."""
    max_inline_total_bytes: int = 256 * 2**20
    """Most bytes of media the gateway holds inlined for all requests in flight together (503 beyond)."""
    health_interval_s: float = 2.0
    eject_after_failures: int = 2
    heartbeat_timeout_s: float = 10.0
    """A self-registered Eric (eric-epd serve --register-with) not heard from for this long is dropped."""
    encode_timeout_s: float = 60.0
    upstream_timeout_s: float = 300.0
    stream_write_timeout_s: float = 30.0
    """A streaming client that takes no data for this long has its stream closed (and the engine's released)."""
    sglang_bootstrap_port: int = 8998
    text_encoder_urls: tuple[str, ...] = ()
    """vLLM instances serving an image model's text encoder as a pooling model (token_embed), for
    /v1/images/generations; they check --upstream-api-key."""
    geri_urls: tuple[str, ...] = ()
    """Geri servers that turn those hidden states into images."""
    geri_api_key: str | None = None
    """Sent to the Geris (--geri-api-key, or $GERI_API_KEY)."""
    image_urls: bool = False
    """Serve response_format "url": images kept in memory under unguessable names at /v1/images/files/."""
    image_url_ttl_s: float = 3600.0
    image_store_bytes: int = 512 * 2**20
    heap_keep_bytes: int = DEFAULT_KEEP_BYTES
    """Freed memory each malloc arena of the gateway keeps for reuse (eric_epd/common/heap.py); 0: glibc's defaults."""

    def __post_init__(self) -> None:
        if self.backend not in ("vllm", "sglang"):
            raise ValueError("backend must be vllm or sglang")
        if bool(self.text_encoder_urls) != bool(self.geri_urls):
            raise ValueError("image generation needs both --text-encoder-urls and --geri-urls")
        if not self.colocated_urls and not (self.prefill_urls and self.decode_urls) and not self.geri_urls:
            raise ValueError(
                "give --colocated-urls, or both --prefill-urls and --decode-urls (or, for images only, "
                "--text-encoder-urls and --geri-urls)"
            )
        if self.epd_prefill_urls and (self.backend != "sglang" or not (self.decode_urls or self.colocated_urls)):
            raise ValueError("--epd-prefill-urls is for --backend sglang, with --decode-urls or --colocated-urls")
        if self.dns_interval_s <= 0 or self.stream_write_timeout_s <= 0:
            raise ValueError("--dns-interval and --stream-write-timeout must be > 0")
        if self.encoder_dns and self.backend != "vllm":
            raise ValueError("--encoder-dns is for --backend vllm (SGLang's prefills call their own --encoder-urls)")
        if self.max_inline_bytes < 1 or self.max_inline_total_bytes < self.max_inline_bytes:
            raise ValueError("--max-inline-bytes must be >= 1 and --max-inline-total-bytes at least as large")
        if self.epd_min_items < 1 or self.max_items < 1:
            raise ValueError("--epd-min-items and --max-items must be >= 1")
        if self.max_items > MAX_HANDLES // 2:  # a video's soundtrack is a handle of its own
            raise ValueError(f"--max-items is at most {MAX_HANDLES // 2}: vLLM's connector takes {MAX_HANDLES} handles")
        if self.max_image_requests < 1:
            raise ValueError("--max-image-requests must be >= 1")
        if not (0 < self.image_url_ttl_s < math.inf) or self.image_store_bytes < 1:
            raise ValueError("--image-url-ttl must be a finite number of seconds > 0, --image-store-bytes >= 1")
        try:
            check_keep_bytes(self.heap_keep_bytes)
        except ValueError as e:
            raise ValueError(f"--heap-keep-bytes: {e}") from None


def _urls(value: str) -> tuple[str, ...]:
    return tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())


def _dns_target(value: str) -> DnsTarget:
    try:
        return parse_dns_target(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    """The GatewayConfig the command line describes (`argv`, or sys.argv when None)."""
    p = argparse.ArgumentParser(prog="epd-gateway", description="OpenAI-compatible EPD/PD gateway")
    p.add_argument("--encoder-urls", type=_urls, default=(), help="comma-separated Eric base URLs")
    p.add_argument(
        "--encoder-dns",
        type=_dns_target,
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="a DNS name whose every address is an Eric on PORT (a Kubernetes headless Service; "
        "repeatable, with or without --encoder-urls): re-resolved every --dns-interval seconds, an "
        "address that appears starts receiving items, one that vanishes stops (calls in flight to it "
        "finish); a failed lookup keeps the last members",
    )
    p.add_argument(
        "--dns-interval",
        type=float,
        default=GatewayConfig.dns_interval_s,
        help="seconds between lookups of each --encoder-dns name",
    )
    p.add_argument(
        "--prefill-urls",
        type=_urls,
        default=(),
        help="comma-separated prefill instances (vLLM kv_producer, or SGLang prefill)",
    )
    p.add_argument(
        "--decode-urls",
        type=_urls,
        default=(),
        help="comma-separated decode instances (vLLM kv_consumer, or SGLang decode)",
    )
    p.add_argument("--colocated-urls", type=_urls, default=(), help="instances that prefill and decode")
    p.add_argument(
        "--epd-prefill-urls",
        type=_urls,
        default=(),
        help="SGLang: --language-only servers using the Erics as --encoder-urls (EPD requests go there): prefills "
        "joined to --decode-urls, or, beside --colocated-urls, servers that decode too",
    )
    p.add_argument("--backend", choices=("vllm", "sglang"), default="vllm", help="the engines behind the gateway")
    p.add_argument(
        "--epd-min-items",
        type=int,
        default=2,
        help="requests with at least this many media items take the encoder path (media the engine "
        "encoded itself on an earlier plain turn of the chat do not count)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--trusted-proxies", type=parse_trusted_proxies, default=(), help=TRUSTED_PROXIES_HELP)
    p.add_argument(
        "--api-key", default=None, help="clients must send 'Authorization: Bearer KEY' (default: $EPD_GATEWAY_API_KEY)"
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help="key for /admin/encoders (default: $EPD_GATEWAY_ADMIN_KEY; registration is off without it)",
    )
    p.add_argument(
        "--metrics-key",
        default=None,
        help="key Prometheus sends to read /metrics (default: $EPD_GATEWAY_METRICS_KEY; the admin key "
        "reads them too; with neither, /metrics answers 401)",
    )
    p.add_argument(
        "--register-from",
        type=parse_network,
        action="append",
        default=[],
        metavar="CIDR",
        help="network Erics may register from, and whose addresses a registered URL must resolve to "
        "(repeatable; none: registration is refused). Naming a network says Erics there may be sent "
        "clients' media (URLs and data: images); they get the --eric-api-key only with proof that "
        "they hold it",
    )
    p.add_argument("--eric-api-key", default=None, help="the Erics' --api-key (default: $ERIC_API_KEY)")
    p.add_argument(
        "--stream-write-timeout",
        type=float,
        default=GatewayConfig.stream_write_timeout_s,
        help="seconds a streaming client may go without taking data before its stream is closed (the "
        "engine's stream is released with it)",
    )
    p.add_argument(
        "--upstream-api-key",
        default=None,
        help="the engines' --api-key, sent instead of the client's (default: $VLLM_API_KEY)",
    )
    p.add_argument(
        "--allow-client-embeddings",
        type=Path,
        default=None,
        metavar="MODEL_DIR",
        help="accept image_embeds/video_embeds parts from (trusted) clients, checked against the model "
        "in MODEL_DIR (its config.json); off by default",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=GatewayConfig.max_body_bytes,
        help="largest request body accepted (413 beyond)",
    )
    p.add_argument("--max-items", type=int, default=GatewayConfig.max_items, help="media items per request")
    p.add_argument(
        "--heap-keep-bytes",
        type=int,
        default=GatewayConfig.heap_keep_bytes,
        help="freed memory each malloc arena of the gateway keeps for reuse (at least 1 MiB), so bodies of megabytes "
        "do not fault fresh pages in each time (glibc's mallopt; 0: the allocator's own defaults)",
    )
    p.add_argument(
        "--max-image-requests",
        type=int,
        default=GatewayConfig.max_image_requests,
        help="image generations in progress at most; past it a 503 with Retry-After",
    )
    p.add_argument("--allow-private-hosts", action="store_true", help="allow media URLs on private addresses")
    p.add_argument("--allowed-host", action="append", default=[], help="media host always allowed (repeatable)")
    p.add_argument(
        "--file-root",
        type=Path,
        action="append",
        default=[],
        help="allow file:// media under this directory (repeatable; encoders must see the same path)",
    )
    p.add_argument(
        "--max-media-bytes",
        type=int,
        default=MediaLimits.max_bytes,
        help="most bytes of one media item the gateway fetches for the engines' own path (they are "
        "handed data: URLs, never a client's URL)",
    )
    p.add_argument(
        "--max-inline-bytes",
        type=int,
        default=GatewayConfig.max_inline_bytes,
        help="most bytes of media the gateway fetches and inlines for one request, all its parts together "
        "(a URL named twice counts twice; fetched once); 413 beyond. Default: the --max-body-bytes "
        "default, so an inlined request is about as large as a client could send itself",
    )
    p.add_argument(
        "--max-inline-total-bytes",
        type=int,
        default=GatewayConfig.max_inline_total_bytes,
        help="most bytes of media the gateway holds inlined for every request in flight together; a "
        "request that would pass it is a 503 with Retry-After (the gateway's memory stays bounded)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=MediaLimits.timeout_s,
        help="seconds to fetch one media item, redirects included (and to resolve all of a request's "
        "media hosts before fetching)",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=GatewayConfig.health_interval_s,
        help="seconds between health and load probes of each Eric",
    )
    p.add_argument(
        "--eject-after-failures",
        type=int,
        default=GatewayConfig.eject_after_failures,
        help="consecutive failures after which an Eric is ejected (readmitted when healthy)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=GatewayConfig.heartbeat_timeout_s,
        help="drop a self-registered Eric not heard from for this many seconds",
    )
    p.add_argument(
        "--sglang-bootstrap-port",
        type=int,
        default=GatewayConfig.sglang_bootstrap_port,
        help="SGLang prefills' KV bootstrap port",
    )
    p.add_argument(
        "--text-encoder-urls",
        type=_urls,
        default=(),
        help="vLLM pooling instances of the image model's text encoder (for /v1/images/generations)",
    )
    p.add_argument("--geri-urls", type=_urls, default=(), help="Geri servers (for /v1/images/generations)")
    p.add_argument("--geri-api-key", default=None, help="the Geris' --api-key (default: $GERI_API_KEY)")
    p.add_argument(
        "--image-urls",
        action="store_true",
        help='serve response_format "url": images kept in memory, linked under /v1/images/files/',
    )
    p.add_argument(
        "--image-url-ttl", type=float, default=GatewayConfig.image_url_ttl_s, help="seconds a linked image is kept"
    )
    p.add_argument(
        "--image-store-bytes",
        type=int,
        default=GatewayConfig.image_store_bytes,
        help="most bytes of linked images kept (oldest dropped first)",
    )
    a = p.parse_args(argv)
    return GatewayConfig(
        encoder_urls=a.encoder_urls,
        encoder_dns=tuple(dict.fromkeys(a.encoder_dns)),
        dns_interval_s=a.dns_interval,
        prefill_urls=a.prefill_urls,
        decode_urls=a.decode_urls,
        colocated_urls=a.colocated_urls,
        epd_prefill_urls=a.epd_prefill_urls,
        backend=a.backend,
        epd_min_items=a.epd_min_items,
        host=a.host,
        port=a.port,
        trusted_proxies=a.trusted_proxies,
        api_key=a.api_key or os.environ.get("EPD_GATEWAY_API_KEY") or None,
        admin_key=a.admin_key or os.environ.get("EPD_GATEWAY_ADMIN_KEY") or None,
        register_from=tuple(a.register_from),
        metrics_key=a.metrics_key or os.environ.get("EPD_GATEWAY_METRICS_KEY") or None,
        eric_api_key=a.eric_api_key or os.environ.get("ERIC_API_KEY") or None,
        upstream_api_key=a.upstream_api_key or os.environ.get("VLLM_API_KEY") or None,
        stream_write_timeout_s=a.stream_write_timeout,
        client_embeddings=EmbeddingShape.from_checkpoint(a.allow_client_embeddings)
        if a.allow_client_embeddings
        else None,
        max_body_bytes=a.max_body_bytes,
        max_items=a.max_items,
        url_policy=UrlPolicy(
            allow_private_hosts=a.allow_private_hosts,
            host_allowlist=frozenset(a.allowed_host),
            file_roots=tuple(r.resolve() for r in a.file_root),
        ),
        media_limits=MediaLimits(max_bytes=a.max_media_bytes, timeout_s=a.media_fetch_timeout),
        max_inline_bytes=a.max_inline_bytes,
        max_inline_total_bytes=a.max_inline_total_bytes,
        health_interval_s=a.health_interval,
        eject_after_failures=a.eject_after_failures,
        heartbeat_timeout_s=a.heartbeat_timeout,
        sglang_bootstrap_port=a.sglang_bootstrap_port,
        text_encoder_urls=a.text_encoder_urls,
        geri_urls=a.geri_urls,
        geri_api_key=a.geri_api_key or os.environ.get("GERI_API_KEY") or None,
        image_urls=a.image_urls,
        image_url_ttl_s=a.image_url_ttl,
        image_store_bytes=a.image_store_bytes,
        max_image_requests=a.max_image_requests,
        heap_keep_bytes=a.heap_keep_bytes,
    )
