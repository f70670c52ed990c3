"""Reads and rewrites the media parts of OpenAI chat requests (counting, URL policy, the media an engine may be given,
embeds substitution)."""

from __future__ import annotations

import copy
import functools
import hashlib
import re
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from eric_epd.common.errors import ApiError
from eric_epd.common.jsonbody import MAX_URL
from eric_epd.media.engine_probe import Reader, check_for_engine, data_url_reader
from eric_epd.media.url_policy import MediaError, UrlPolicy, url_scheme
from eric_epd.wire.eric import MEDIA, EncodedItem
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import handles_xargs, soundtrack_uuid, soundtracks_xargs

MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio", "input_audio": "audio"}
"""The content part types the gateway routes, by their item's modality."""
AUDIO_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+-]{0,15}")
"""An `input_audio` part's `format` (wav, mp3, flac, ...): it becomes the media type of the data: URL."""


@dataclass(frozen=True)
class MediaRef:
    """Where one media item sits in the request."""

    message: int
    part: int
    modality: str
    url: str
    kind: str = ""
    """The part's type (image_url, video_url, audio_url, input_audio); empty: `<modality>_url`."""
    with_audio: bool = False
    """A video whose soundtrack goes to the model too (vLLM's `use_audio_in_video`): Eric encodes both."""

    @property
    def modalities(self) -> set[str]:
        """What the model takes from this item: its modality, and audio for a video with its soundtrack."""
        return {self.modality, "audio"} if self.with_audio else {self.modality}

    @property
    def part_type(self) -> str:
        """The type of the content part this item is."""
        return self.kind or f"{self.modality}_url"

    @functools.cached_property
    def routing_key(self) -> bytes:
        """Stable key for consistent hashing: the same image (same URL or bytes) lands on the same Eric. Computed once
        per item (an inlined URL is the media's bytes), however many times placement and plain_media ask."""
        return hashlib.blake2b(self.url.encode(), digest_size=8).digest()


def _part_url(part: dict[str, Any], kind: str, where: str) -> str:
    """A media part's URL; for `input_audio` the data: URL vLLM makes of it (data:audio/<format>;base64,<data>),
    which is what Eric is sent."""
    value = part.get(kind)
    if kind == "input_audio":
        return _input_audio_url(value, where)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: '{kind}' needs a non-empty 'url'", param=kind)
    if len(url) > MAX_URL and url_scheme(url) != "data":  # before any parsing: a data: URL is bounded by the body
        raise ApiError(400, f"{where}: the url is {len(url)} characters long, over the limit of {MAX_URL}", param=kind)
    return url


def _input_audio_url(value: Any, where: str) -> str:
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(data, str) or not data:
        raise ApiError(400, f"{where}: 'input_audio' needs a non-empty base64 'data'", param="input_audio")
    fmt = value.get("format")
    if not isinstance(fmt, str) or not AUDIO_FORMAT.fullmatch(fmt):
        raise ApiError(400, f"{where}: 'input_audio' needs a 'format' such as 'wav' or 'mp3'", param="input_audio")
    return f"data:audio/{fmt};base64,{data}"


def collect_media(body: dict[str, Any], policy: UrlPolicy, max_items: int, with_audio: bool = False) -> list[MediaRef]:
    """Every image/video/audio part of a chat request (whose parts boundary.check_messages already validated), each URL
    through the URL policy, each data: URL's bytes checked as an engine's media must be (`check_medium`), each video
    `with_audio` (its soundtrack too) as the request says; 400 for anything the gateway cannot route."""
    refs: list[MediaRef] = []
    for m, message in enumerate(body["messages"]):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            where = f"messages[{m}].content[{p}]"
            kind = part["type"]
            if kind in MEDIA_PARTS:
                url = _part_url(part, kind, where)
                modality = MEDIA_PARTS[kind]
                try:
                    policy.check(url)
                    if url_scheme(url) == "data":  # its bytes are here: checked now (fetched ones: inline.py)
                        check_for_engine(data_url_reader(url), modality)
                except MediaError as e:
                    raise ApiError(e.status if e.status < 500 else 400, f"{where}: {e.message}") from e
                refs.append(MediaRef(m, p, modality, url, kind, with_audio and modality == "video"))
    if len(refs) > max_items:
        raise ApiError(400, f"too many media items: {len(refs)} > {max_items}", param="messages")
    return refs


def check_medium(read: Reader, modality: str, where: str) -> None:
    """400 naming the part (`where`) unless the medium `read` gives is one an engine may be given: a container of the
    part's modality's allowlist, told from its leading bytes, with no text a probing FFmpeg would follow
    (`engine_probe.check_for_engine`). vLLM's own loaders probe the media they are handed."""
    try:
        check_for_engine(read, modality)
    except MediaError as e:
        raise ApiError(e.status if e.status < 500 else 400, f"{where}: {e.message}") from e


def remote_hosts(refs: list[MediaRef]) -> set[tuple[str, int]]:
    """(host, port) of every http(s) media URL, for DNS-time policy checks."""
    hosts = set()
    for ref in refs:
        parts = urlsplit(ref.url[: MAX_URL + 1])  # scheme and host lie within a fetchable URL's bound: a 64 MiB
        # data: URL is not parsed whole on the event loop
        if parts.scheme in ("http", "https") and parts.hostname:
            hosts.add((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)))
    return hosts


def vllm_can_place(items: list[EncodedItem]) -> bool:
    """vLLM (0.32, 0.33) keeps only the grid of a metadata-only video and spaces its frames 1 s per temporal grid
    step (it drops second_per_grid_ts); a Qwen2.5-VL video sampled at another rate must go with its raw media."""
    return all(abs((i.second_per_grid_ts if i.second_per_grid_ts is not None else 1.0) - 1.0) < 1e-6 for i in items)


def kept_handles(items: list[EncodedItem]) -> dict[str, EmbeddingHandle]:
    """The one handle per content hash the engine gets: the same content under several URLs (or as an audio part and
    a video's soundtrack) may come back from several Erics (or calls), each with its own lease; the first kept."""
    first: dict[str, EmbeddingHandle] = {}
    for item in [*items, *soundtracks(items)]:
        first.setdefault(item.hash, item.handle)
    return first


def spare_handles(items: list[EncodedItem]) -> list[EmbeddingHandle]:
    """The handles whose leases nobody will use (not kept_handles' choice for their content), to give back now."""
    kept = kept_handles(items)
    return [item.handle for item in [*items, *soundtracks(items)] if item.handle.lease != kept[item.hash].lease]


def inlined_refs(body: dict[str, Any], refs: list[MediaRef]) -> list[MediaRef]:
    """`refs` as they stand in `body`, the request with its media inlined (inline.RawBody): each URL the data: URL
    the engine will get, so an Eric encodes those very bytes and nobody fetches the client's URL twice."""
    return [
        replace(
            ref,
            url=_part_url(
                body["messages"][ref.message]["content"][ref.part],
                ref.part_type,
                f"messages[{ref.message}].content[{ref.part}]",
            ),
        )
        for ref in refs
    ]


def with_embeddings(body: dict[str, Any], refs: list[MediaRef], items: list[EncodedItem]) -> dict[str, Any]:
    """A copy of the request whose media parts are keyed by Eric's content hash (the gateway mints every uuid, from
    content Eric encoded; a video with its soundtrack by soundtrack_uuid of both), with the handles and their lease
    tokens beside it. An item placed by its grid becomes a metadata-only embeds part; an item placed by its media
    (the generic path) keeps its part as it is in `body`, which then has its media inlined, and gains the uuid: the
    engine's own processor lays out its placeholder and the connector fills it with Eric's rows."""
    out = dict(body)
    out["messages"] = copy.deepcopy(body["messages"])
    for ref, item in zip(refs, items, strict=True):
        content = out["messages"][ref.message]["content"]
        uuid = item.hash if item.soundtrack is None else soundtrack_uuid(item.hash, item.soundtrack.hash)
        if item.placement == MEDIA:
            content[ref.part] = {**content[ref.part], "uuid": uuid}
            continue
        kind = f"{ref.modality}_embeds"
        fields: dict[str, Any] = {f"{ref.modality}_grid_thw": item.grid_thw}
        if item.timestamps is not None:  # Qwen3-VL videos: vLLM writes each temporal step's time into the prompt
            fields["timestamps"] = item.timestamps
        content[ref.part] = {"type": kind, kind: fields, "uuid": uuid}
    pairs = [(item.hash, item.soundtrack.hash) for item in items if item.soundtrack is not None]
    # one handle per content (the others' leases go back: spare_handles), and which is which video's soundtrack
    out["vllm_xargs"] = handles_xargs(kept_handles(items).values()) | soundtracks_xargs(pairs)
    return out


def soundtracks(items: list[EncodedItem]) -> list[EncodedItem]:
    """The soundtracks Eric answered for videos sent with `use_audio_in_video` (audio items of their own)."""
    return [item.soundtrack for item in items if item.soundtrack is not None]
