"""`eric-epd serve`: the command line of an Eric encode server, parsed once into an EricConfig."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from eric_epd.common.cpus import parse_cpus
from eric_epd.common.net import is_loopback
from eric_epd.common.proxies import TRUSTED_PROXIES_HELP, parse_trusted_proxies
from eric_epd.eric.config import COMPILE_MODES, COMPUTE_DTYPES, SGLANG_DTYPES, BatchLimits, EricConfig, SglangConfig
from eric_epd.eric.media_flags import add_media_flags, media_limits
from eric_epd.eric.sglang.video import SglangVideo
from eric_epd.media.url_policy import UrlPolicy
from eric_epd.runtime.cli import add_server_flags
from eric_epd.transfer.config import TRANSFER_BACKENDS, TransferConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand and its flags to the `eric-epd` parser."""
    p = sub.add_parser("serve", help="run an Eric encode server")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or Hugging Face repo id; a repo id fetches only the configs and the "
        "encoder's shards, through the hub cache (HF_HUB_OFFLINE works) (default: the built-in tiny "
        "Qwen2-VL)",
    )
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub --model")
    add_server_flags(
        p,
        what="encoder",
        dtype_help="dtype of the rows sent (the engine's model dtype; auto: the checkpoint's)",
        port=8100,
    )
    p.add_argument(
        "--compute-dtype",
        choices=COMPUTE_DTYPES,
        default=EricConfig.compute_dtype,
        help="dtype the vision tower computes in; its rows are cast to --dtype as they leave it (auto: --dtype, "
        "except float32 on a CPU without units for a bfloat16/float16 --dtype: AVX512-BF16 or AMX-BF16, "
        "AVX512-FP16 or AMX-FP16; each worker logs its choice and why)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="callers must send 'Authorization: Bearer KEY' (default: $ERIC_API_KEY; none: no check)",
    )
    p.add_argument("--trusted-proxies", type=parse_trusted_proxies, default=(), help=TRUSTED_PROXIES_HELP)
    p.add_argument(
        "--max-batch-items", type=int, default=BatchLimits.max_items, help="most media items in one encoder batch"
    )
    p.add_argument(
        "--max-batch-patches",
        type=int,
        default=BatchLimits.max_patches,
        help="most vision patches per batch (0: 4096 on CPU, 32768 on CUDA)",
    )
    p.add_argument(
        "--max-queued-items",
        type=int,
        default=BatchLimits.max_queued_items,
        help="most items accepted and not answered yet (fetching, preprocessing, queued or encoding); "
        "beyond it a request gets 503 before anything of it is fetched",
    )
    p.add_argument(
        "--batches-in-flight",
        type=int,
        choices=(0, 1, 2),
        default=BatchLimits.in_flight,
        help="batches handed to the workers at once (2: the next is ready while one computes; 0: 2 on CUDA, 1 on CPU)",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=EricConfig.compile,
        help="run the vision tower eagerly (none) or through torch.compile (inductor: each block's parts "
        "around attention, weights frozen in, any batch size; CUDA graphs on CUDA); the workers "
        "compile at start, before the server is ready. The Qwen families' towers only",
    )
    p.add_argument(
        "--cpus",
        type=parse_cpus,
        default=(),
        help="CPUs this Eric may use, e.g. 0-3 (workers split them; default: all); leave the rest to "
        "an engine on the same host",
    )
    p.add_argument("--preprocess-threads", type=int, default=0, help="0: one per CPU of --cpus, at most 4")
    p.add_argument(
        "--alias-entries",
        type=int,
        default=EricConfig.alias_entries,
        help="most raw-bytes aliases kept (fetched bytes -> content hash, least recently used dropped): an item "
        "sent again while its embedding is still in the pool is answered without decoding it (0: off)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=EricConfig.max_body_bytes,
        help="largest request body accepted (413 beyond)",
    )
    p.add_argument(
        "--max-items-per-request",
        type=int,
        default=EricConfig.max_items_per_request,
        help="most media items in one /v1/encode request",
    )
    p.add_argument(
        "--file-root",
        type=Path,
        action="append",
        default=[],
        help="allow file:// URLs under this directory (repeatable)",
    )
    p.add_argument(
        "--allow-private-hosts", action="store_true", help="allow media URLs on loopback/private/link-local addresses"
    )
    p.add_argument("--allowed-host", action="append", default=[], help="host always allowed for media URLs")
    p.add_argument(
        "--pool-bytes",
        type=int,
        default=TransferConfig.pool_bytes,
        help="size of the shared-memory pool holding finished embeddings",
    )
    p.add_argument(
        "--embedding-ttl", type=float, default=TransferConfig.ttl_s, help="seconds an unacknowledged embedding is kept"
    )
    p.add_argument(
        "--pool-wait",
        type=float,
        default=TransferConfig.pool_wait_s,
        help="seconds new work waits for pool space before 503",
    )
    p.add_argument(
        "--keep-acked-bytes",
        type=int,
        default=TransferConfig.keep_acked_bytes,
        help="keep acknowledged embeddings as a content cache up to this many bytes (0: free at ack)",
    )
    p.add_argument(
        "--transfer-backends",
        default=",".join(TransferConfig.backends),
        help=f"comma-separated subset of {TRANSFER_BACKENDS} (HTTP is always on)",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host consumers use to reach this Eric (default: --host, or 127.0.0.1 for 0.0.0.0)",
    )
    p.add_argument(
        "--mooncake-protocol",
        choices=("tcp", "rdma"),
        default="tcp",
        help="Mooncake transfer protocol (rdma needs an RDMA NIC)",
    )
    p.add_argument("--mooncake-device", default="", help="RDMA device names for Mooncake")
    p.add_argument(
        "--global-cache",
        default=None,
        metavar="MASTER_HOST:PORT",
        help="share finished embeddings with other Erics through this Mooncake Store master",
    )
    p.add_argument(
        "--global-cache-bytes",
        type=int,
        default=EricConfig.global_cache_bytes,
        help="memory this Eric contributes to the store",
    )
    p.add_argument(
        "--register-with",
        action="append",
        default=[],
        help="gateway base URL to join by itself (repeatable): registers, heartbeats, leaves on shutdown",
    )
    p.add_argument("--register-key", default=None, help="the gateways' --admin-key (default: $EPD_GATEWAY_ADMIN_KEY)")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=EricConfig.heartbeat_s,
        help="seconds between registrations (the gateway drops an Eric whose heartbeats stop)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=EricConfig.drain_timeout_s,
        help="on shutdown (SIGTERM), seconds the leases handed out may take to be read and acknowledged "
        "while new encodes are refused",
    )
    add_media_flags(p)
    g = p.add_argument_group("SGLang encoder protocol (for --language-only --encoder-urls prefills)")
    g.add_argument("--no-sglang", action="store_true", help="do not serve SGLang's encoder endpoints")
    g.add_argument(
        "--sglang-register-url",
        action="append",
        default=[],
        help="SGLang encoder bootstrap server to register with (repeatable)",
    )
    g.add_argument(
        "--sglang-dtype",
        choices=SGLANG_DTYPES,
        default=SglangConfig.dtype,
        help="dtype of the rows sent: the prefill's --dtype (auto: SGLang's own rule)",
    )
    g.add_argument(
        "--sglang-send-timeout",
        type=float,
        default=_env_float("SGLANG_ENCODER_SEND_TIMEOUT", SglangConfig.send_timeout_s),
        help="seconds a finished part waits for its ranks",
    )
    g.add_argument(
        "--sglang-req-timeout",
        type=float,
        default=_env_float("SGLANG_ENCODER_REQ_TIMEOUT", SglangConfig.req_timeout_s),
        help="seconds a rank's early call waits for the part's /encode",
    )
    g.add_argument(
        "--sglang-mooncake-protocol",
        default=os.environ.get("MOONCAKE_PROTOCOL", "rdma"),
        choices=("rdma", "tcp", "efa"),
        help="transport of the Mooncake pushes to SGLang: the prefills' MOONCAKE_PROTOCOL (SGLang's "
        "default: rdma; this flag defaults to MOONCAKE_PROTOCOL from the environment, else rdma)",
    )
    g.add_argument(
        "--sglang-allowed-peer",
        action="append",
        default=[],
        help="CIDR Eric may push SGLang parts to besides the caller's own address (repeatable)",
    )
    g.add_argument(
        "--sglang-mm-process-config",
        type=_sglang_video,
        default="{}",
        help='the prefills\' SGLang --mm-process-config JSON: its "video" settings (fps, nframes, min_frames, '
        "max_frames, min_pixels, max_pixels, total_pixels) decide how Eric samples and first resizes Qwen-VL videos "
        "asked for on SGLang's protocol, as SGLang's own encoder would (VIDEO_MAX_PIXELS from the environment too)",
    )
    g.add_argument(
        "--sglang-register-retry",
        type=float,
        default=SglangConfig.register_retry_s,
        help="seconds between registration attempts",
    )
    g.add_argument(
        "--sglang-max-parts",
        type=int,
        default=SglangConfig.max_parts,
        help="most SGLang parts (req_ids) held at once; new ones past it get 503",
    )
    g.add_argument(
        "--sglang-max-receivers",
        type=int,
        default=SglangConfig.max_receivers,
        help="most cached ZMQ sockets to prefill ranks (the least recently used idle one is closed)",
    )
    g.add_argument(
        "--sglang-receiver-idle-ttl",
        type=float,
        default=SglangConfig.receiver_idle_s,
        help="seconds after which an unused cached ZMQ socket to a prefill rank is closed",
    )


def _sglang_video(text: str) -> SglangVideo:
    """--sglang-mm-process-config: SGLang's JSON, of which the "video" settings count here."""
    try:
        mm = json.loads(text)
        if not isinstance(mm, dict):
            raise ValueError("a JSON object is expected")
        return SglangVideo.from_config(mm.get("video") or {}, os.environ.get("VIDEO_MAX_PIXELS"))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--sglang-mm-process-config: {e}") from e


def _env_float(name: str, default: float) -> float:
    """A default taken from SGLang's own environment variable, so Eric and the prefill agree when it is set."""
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


def model_or_default(model: str | Path | None, revision: str | None = None) -> Path:
    """The given checkpoint (a directory, or a hub id resolved through the hub cache), or the built-in tiny random
    Qwen2-VL (built offline on first use)."""
    if model is None:
        from eric_epd.checkpoints.builtin import ensure_checkpoint

        return ensure_checkpoint("qwen2_vl", "tiny").resolve()
    from eric_epd.models.hub import resolve_model

    try:
        return resolve_model(str(model), revision)
    except (ValueError, OSError) as e:
        raise SystemExit(f"eric-epd: --model {model}: {e}") from None


def _check_reachable(host: str, advertise_host: str | None) -> None:
    """An address advertised to other hosts must be one Eric listens on: refuse a loopback bind with it."""
    if advertise_host is None or is_loopback(advertise_host) or not is_loopback(host):
        return
    raise SystemExit(
        f"eric-epd serve: --advertise-host {advertise_host} is given but --host {host} listens on "
        "loopback only, so consumers on other hosts cannot reach it; add --host 0.0.0.0 (or the "
        "interface's own address)"
    )


def config_from_args(args: argparse.Namespace) -> EricConfig:
    """Parse once; the result goes to every process."""
    _check_reachable(args.host, args.advertise_host)
    return EricConfig(
        model=model_or_default(args.model, args.revision),
        tp_size=args.tp,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        cpus=args.cpus,
        preprocess_threads=args.preprocess_threads,
        alias_entries=args.alias_entries,
        liveness_timeout_s=args.liveness_timeout,
        heap_keep_bytes=args.heap_keep_bytes,
        max_body_bytes=args.max_body_bytes,
        max_items_per_request=args.max_items_per_request,
        batch=BatchLimits(args.max_batch_items, args.max_batch_patches, args.max_queued_items, args.batches_in_flight),
        media=media_limits(args),
        transfer=TransferConfig(
            pool_bytes=args.pool_bytes,
            ttl_s=args.embedding_ttl,
            pool_wait_s=args.pool_wait,
            keep_acked_bytes=args.keep_acked_bytes,
            backends=tuple(b for b in args.transfer_backends.split(",") if b),
            advertise_host=args.advertise_host or (args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"),
            mooncake_protocol=args.mooncake_protocol,
            mooncake_device=args.mooncake_device,
        ),
        sglang=SglangConfig(
            enabled=not args.no_sglang,
            register_urls=tuple(u.rstrip("/") for u in args.sglang_register_url),
            dtype=args.sglang_dtype,
            send_timeout_s=args.sglang_send_timeout,
            req_timeout_s=args.sglang_req_timeout,
            register_retry_s=args.sglang_register_retry,
            allowed_peers=tuple(args.sglang_allowed_peer),
            mooncake_protocol=args.sglang_mooncake_protocol,
            max_parts=args.sglang_max_parts,
            max_receivers=args.sglang_max_receivers,
            receiver_idle_s=args.sglang_receiver_idle_ttl,
            video=args.sglang_mm_process_config,
        ),
        api_key=args.api_key or os.environ.get("ERIC_API_KEY") or None,
        trusted_proxies=args.trusted_proxies,
        global_cache=args.global_cache,
        global_cache_bytes=args.global_cache_bytes,
        register_with=tuple(u.rstrip("/") for u in args.register_with),
        register_key=args.register_key or os.environ.get("EPD_GATEWAY_ADMIN_KEY") or None,
        heartbeat_s=args.heartbeat,
        drain_timeout_s=args.drain_timeout,
        compile=args.compile,
        compute_dtype=args.compute_dtype,
        url_policy=UrlPolicy(
            file_roots=tuple(r.resolve() for r in args.file_root),
            allow_private_hosts=args.allow_private_hosts,
            host_allowlist=frozenset(args.allowed_host),
        ),
    )
