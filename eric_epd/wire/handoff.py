"""The Eric handles an EPD request carries to vLLM beside it (`vllm_xargs` -> `sampling_params.extra_args`), written
by the gateway alone, and the connector's checks on them: where they point and the tensor they describe."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import msgspec

from eric_epd.common.widths import embedding_width, embedding_widths
from eric_epd.wire.handles import DTYPE_BYTES, EmbeddingHandle, HandleError, check_handle

__all__ = [
    "DTYPE_BYTES",
    "EXTRA_ARGS_KEY",
    "SOUNDTRACKS_KEY",
    "HandleError",
    "check_handle",
    "embedding_width",
    "handles_xargs",
    "model_embedding_width",
    "model_embedding_widths",
    "offered_handles",
    "offered_producers",
    "offered_soundtracks",
    "soundtrack_uuid",
    "soundtracks_xargs",
]

EXTRA_ARGS_KEY = "eric_handles"
"""Key in vllm_xargs / SamplingParams.extra_args: a JSON list of handles (each with its lease token)."""
MAX_HANDLES = 256
SOUNDTRACKS_KEY = "eric_soundtracks"
"""Key in vllm_xargs: a JSON list of [video hash, soundtrack hash] pairs, for videos sent with vLLM's
`use_audio_in_video` (both handles are in EXTRA_ARGS_KEY's list). vLLM names a soundtrack after its video's uuid, so
such a video's uuid is soundtrack_uuid of the pair: two videos of the same frames with other soundtracks are never
one item to vLLM (its caches would give one the other's soundtrack)."""


def handles_xargs(handles: Iterable[dict[str, Any] | EmbeddingHandle]) -> dict[str, str]:
    """The vllm_xargs (or SamplingParams.extra_args) entry that hands `handles` to the connector."""
    return {EXTRA_ARGS_KEY: msgspec.json.encode(list(handles)).decode()}


class _Producer(msgspec.Struct):
    producer: str


def offered_producers(extra_args: dict[str, Any] | None) -> set[str]:
    """The producers a request's handles name (none if they do not parse: offered_handles then says why)."""
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if not isinstance(raw, str | bytes):
        return set()
    try:
        return {h.producer for h in msgspec.json.decode(raw, type=list[_Producer])[:MAX_HANDLES]}
    except msgspec.DecodeError:
        return set()


def offered_handles(
    extra_args: dict[str, Any] | None, eric_urls: Collection[str], width: int | Collection[int]
) -> dict[str, EmbeddingHandle]:
    """hash -> handle from a request's extra_args, each checked (HandleError names the first problem); `eric_urls`
    is any collection of the trusted producers (a tuple, or the connector's TrustedProducers); `width` one width or
    the model's set of widths (see check_handle)."""
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


def returnable_handles(
    extra_args: dict[str, Any] | None, eric_urls: Collection[str], width: int | Collection[int]
) -> list[EmbeddingHandle]:
    """The handles of a request whose handles were refused as a whole (HandleError) that may still be given back:
    each one that passes check_handle alone (a trusted producer's, well formed). None of a body that is no list of
    handles, nor beyond MAX_HANDLES."""
    raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
    try:
        handles = msgspec.json.decode(raw if isinstance(raw, str | bytes) else b"", type=list[EmbeddingHandle])
    except msgspec.DecodeError:
        return []
    fine = []
    for h in handles[:MAX_HANDLES]:
        try:
            check_handle(h, eric_urls, width)
        except HandleError:
            continue
        fine.append(h)
    return fine


def model_embedding_width(model_config: Any) -> int:
    """Width of the rows the model's own encoder hands its language model, from vLLM's model config (its
    transformers config as a dict): the one rule, embedding_width."""
    return embedding_width(model_config.hf_config.to_dict())


def model_embedding_widths(model_config: Any) -> dict[str, int]:
    """The row width of each modality ("image", "video", "audio") from vLLM's model config: embedding_widths."""
    return embedding_widths(model_config.hf_config.to_dict())


def soundtrack_uuid(video: str, soundtrack: str) -> str:
    """The uuid of a video sent with its soundtrack, which vLLM also names the soundtrack after: both content hashes,
    hashed (a video's own hash covers only its frames)."""
    return hashlib.sha256(f"eric-epd/audio-in-video\0{video}\0{soundtrack}".encode()).hexdigest()


def soundtracks_xargs(pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The vllm_xargs entry that tells the connector which handle is which video's soundtrack ((video hash, audio
    hash) pairs); none for no pairs."""
    return {SOUNDTRACKS_KEY: msgspec.json.encode(list(pairs)).decode()} if pairs else {}


def offered_soundtracks(extra_args: dict[str, Any] | None, handles: Collection[str]) -> list[tuple[str, str]]:
    """(video hash, soundtrack hash) pairs from a request's extra_args, each a pair of `handles` (HandleError
    otherwise)."""
    raw = (extra_args or {}).get(SOUNDTRACKS_KEY)
    if raw is None:
        return []
    try:
        pairs = msgspec.json.decode(raw if isinstance(raw, str | bytes) else b"", type=list[tuple[str, str]])
    except msgspec.DecodeError as e:
        raise HandleError(f"{SOUNDTRACKS_KEY} is not a JSON list of hash pairs: {e}") from e
    if len(pairs) > MAX_HANDLES:
        raise HandleError(f"{len(pairs)} soundtracks > {MAX_HANDLES}")
    stray = next((f"{v[:16]}/{a[:16]}" for v, a in pairs if v not in handles or a not in handles), None)
    if stray is not None:
        raise HandleError(f"{SOUNDTRACKS_KEY} pairs {stray}, not both among the request's handles")
    return pairs
