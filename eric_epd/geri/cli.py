"""`eric-epd geri`: the command line of a Geri server, parsed once into a GeriConfig."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from eric_epd.common.cpus import parse_cpus
from eric_epd.common.proxies import TRUSTED_PROXIES_HELP, parse_trusted_proxies
from eric_epd.geri.config import GeriConfig
from eric_epd.geri.limits import GeriLimits
from eric_epd.runtime.cli import add_server_flags
from eric_epd.runtime.config import BatchLimits

_DEFAULT_BATCH = GeriConfig.__dataclass_fields__["batch"].default_factory()  # type: ignore[misc]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the `geri` subcommand and its flags to the `eric-epd` parser."""
    p = sub.add_parser("geri", help="run a Geri generation server (prompt embeddings in, images out)")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Qwen-Image diffusers checkpoint directory (default: the built-in tiny Qwen-Image)",
    )
    add_server_flags(p, what="generator", dtype_help="auto: bfloat16 on CUDA, float32 on CPU", port=GeriConfig.port)
    p.add_argument(
        "--api-key",
        default=None,
        help="callers must send 'Authorization: Bearer KEY' (default: $GERI_API_KEY; none: no check)",
    )
    p.add_argument("--trusted-proxies", type=parse_trusted_proxies, default=(), help=TRUSTED_PROXIES_HELP)
    p.add_argument("--cpus", type=parse_cpus, default=(), help="CPUs this Geri may use, e.g. 0-3 (default: all)")
    p.add_argument(
        "--max-batch-items", type=int, default=_DEFAULT_BATCH.max_items, help="most images in one denoising batch"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=0, help="most image tokens per batch (0: 4096 on CPU, 65536 on CUDA)"
    )
    p.add_argument(
        "--max-queued-items",
        type=int,
        default=_DEFAULT_BATCH.max_queued_items,
        help="most images waiting; beyond it a request gets 503",
    )
    p.add_argument("--max-side", type=int, default=GeriLimits.max_side, help="largest image width or height accepted")
    p.add_argument(
        "--max-steps", type=int, default=GeriLimits.max_steps, help="most denoising steps a request may ask for"
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=GeriLimits.max_prompt_tokens,
        help="most prompt embedding rows a request may carry",
    )
    p.add_argument(
        "--pool-bytes", type=int, default=GeriConfig.pool_bytes, help="shared memory the workers write images into"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=GeriConfig.max_body_bytes,
        help="largest request body accepted (413 beyond)",
    )
    p.add_argument(
        "--embedding-producers",
        default="",
        help="comma-separated base URLs of the producers whose embedding handles Geri reads (none: "
        "inline embeddings only)",
    )
    p.add_argument("--producer-api-key", default=None, help="the producers' key (default: $ERIC_API_KEY)")
    p.add_argument(
        "--transfer-backends",
        default=",".join(GeriConfig.transfer_backends),
        help="backends Geri may read handles over, best first",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=GeriConfig.request_timeout_s,
        help="seconds a request may take before it gets 504",
    )
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=GeriConfig.worker_timeout_s,
        help="a batch running longer than this marks the workers unhealthy",
    )


def config_from_args(args: argparse.Namespace) -> GeriConfig:
    """The GeriConfig the parsed flags describe (the built-in tiny Qwen-Image when no --model)."""
    if args.model is None:
        from eric_epd.checkpoints.qwen_image import ensure_qwen_image_checkpoint

        model = ensure_qwen_image_checkpoint("tiny")
    else:
        model = args.model.resolve()
    return GeriConfig(
        model=model,
        tp_size=args.tp,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        liveness_timeout_s=args.liveness_timeout,
        heap_keep_bytes=args.heap_keep_bytes,
        cpus=args.cpus,
        api_key=args.api_key or os.environ.get("GERI_API_KEY") or None,
        trusted_proxies=args.trusted_proxies,
        batch=BatchLimits(args.max_batch_items, args.max_batch_tokens, args.max_queued_items),
        limits=GeriLimits(args.max_side, args.max_steps, args.max_prompt_tokens),
        pool_bytes=args.pool_bytes,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        worker_timeout_s=args.worker_timeout,
        producer_urls=tuple(u.strip().rstrip("/") for u in args.embedding_producers.split(",") if u.strip()),
        producer_api_key=args.producer_api_key or os.environ.get("ERIC_API_KEY") or None,
        transfer_backends=tuple(b for b in args.transfer_backends.split(",") if b),
    )
