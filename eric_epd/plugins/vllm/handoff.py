"""The Eric handles an EPD request carries to vLLM beside it (`vllm_xargs` -> `sampling_params.extra_args`), written
by the gateway alone, and the connector's checks on them: where they point and the tensor they describe."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from eric_epd.transfer.handles import EmbeddingHandle

EXTRA_ARGS_KEY = "eric_handles"
"""Key in vllm_xargs / SamplingParams.extra_args: a JSON list of handles (each with its lease token)."""
MAX_HANDLES = 256
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class HandleError(ValueError):
    """An offered handle that the connector must not use: the request fails, the engine does not."""


def handles_xargs(handles: Iterable[dict[str, Any] | EmbeddingHandle]) -> dict[str, str]:
    """The vllm_xargs (or SamplingParams.extra_args) entry that hands `handles` to the connector."""
    return {EXTRA_ARGS_KEY: msgspec.json.encode(list(handles)).decode()}


def offered_handles(extra_args: dict[str, Any] | None, eric_urls: tuple[str, ...], width: int,
                    ) -> dict[str, EmbeddingHandle]:
    """hash -> handle from a request's extra_args, each checked (HandleError names the first problem)."""
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if raw is None:
        return {}
    try:
        handles = msgspec.json.decode(raw if isinstance(raw, str | bytes) else b"", type=list[EmbeddingHandle])
    except msgspec.DecodeError as e:
        raise HandleError(f"{EXTRA_ARGS_KEY} is not a JSON list of Eric handles: {e}") from e
    if len(handles) > MAX_HANDLES:
        raise HandleError(f"{len(handles)} handles > {MAX_HANDLES}")
    for h in handles:
        check_handle(h, eric_urls, width)
    return {h.hash: h for h in handles}


def check_handle(h: EmbeddingHandle, eric_urls: tuple[str, ...], width: int) -> None:
    """The handle points only at a configured Eric, and describes a [rows, width] tensor of its byte length."""
    if h.producer not in eric_urls:
        raise HandleError(f"embedding {h.hash[:16]} is held by {h.producer!r}, which is not one of this engine's "
                          f"Erics {list(eric_urls)}")
    if not h.lease:
        raise HandleError(f"embedding {h.hash[:16]} has no lease token")
    if h.dtype not in DTYPE_BYTES or len(h.shape) != 2 or h.shape[0] < 1 or h.shape[1] != width:
        raise HandleError(f"embedding {h.hash[:16]} is {list(h.shape)} {h.dtype}; this model takes [rows, {width}] "
                          f"in one of {sorted(DTYPE_BYTES)}")
    if h.nbytes != math.prod(h.shape) * DTYPE_BYTES[h.dtype]:
        raise HandleError(f"embedding {h.hash[:16]}: {h.nbytes} bytes do not fit {list(h.shape)} {h.dtype}")
    host = urlsplit(h.producer).hostname
    if h.http != f"{h.producer}/v1/embeddings/{h.hash}":
        raise HandleError(f"embedding {h.hash[:16]}: HTTP location {h.http!r} is not its producer's")
    if h.nixl is not None and not h.nixl.metadata_url.startswith(f"{h.producer}/"):
        raise HandleError(f"embedding {h.hash[:16]}: NIXL metadata {h.nixl.metadata_url!r} is not its producer's")
    if h.mooncake is not None and h.mooncake.session_id.rsplit(":", 1)[0] != host:
        raise HandleError(f"embedding {h.hash[:16]}: Mooncake session {h.mooncake.session_id!r} is not on "
                          f"its producer's host {host}")


def model_embedding_width(model_config: Any) -> int:
    """Width of the rows the model's own encoder hands its language model: hidden size x (1 + DeepStack levels)."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    return int(model_config.get_inputs_embeds_size()) * (1 + levels)
