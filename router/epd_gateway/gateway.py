"""The gateway's routing decisions: EPD (Erics, then prefill/decode) or plain PD per request, with fallbacks."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

import aiohttp
import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from epd_gateway.boundary import audio_in_video, check_messages, check_request_fields, drop_inert_audio_in_video
from epd_gateway.config import GatewayConfig
from epd_gateway.content import (
    MediaRef,
    collect_media,
    inlined_refs,
    remote_hosts,
    spare_handles,
    vllm_can_place,
    with_embeddings,
)
from epd_gateway.embeds import check_embeds_parts
from epd_gateway.encoders import EncoderPool, EncodersUnavailableError
from epd_gateway.image_store import ImageStore
from epd_gateway.images import ImageGenerator
from epd_gateway.inline import MediaInliner, RawBody, check_hosts
from epd_gateway.leases import Leases
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.plain_media import PlainMedia
from epd_gateway.proof import MembershipProver
from epd_gateway.upstream import Upstreams
from eric_epd.common.errors import ApiError, parse_body_off_loop, read_body
from eric_epd.common.jsonbody import MAX_ID
from eric_epd.wire.eric import MEDIA

logger = logging.getLogger(__name__)


async def read_json(request: Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """(raw body, parsed object): the raw bytes are forwarded as they are when nothing needs rewriting."""
    raw = await read_body(request, limit)
    body = await parse_body_off_loop(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_ID):
        raise ApiError(400, f"'model' must be a string of at most {MAX_ID} characters", param="model")
    return raw, body


class Gateway:
    """Routing decisions; the routes (routes.py) are thin."""

    def __init__(
        self,
        config: GatewayConfig,
        client: httpx.AsyncClient,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        unkeyed: httpx.AsyncClient,
        encode_session: aiohttp.ClientSession,
    ) -> None:
        """`client` and `encode_session` (the encode calls) carry the Erics' key and call only the Erics; `unkeyed`
        (no default headers) calls the text encoders and Geris, each with its own key: every upstream gets exactly
        its own key."""
        self.config = config
        self.metrics = metrics
        prover = MembershipProver(unkeyed, config.eric_api_key) if config.eric_api_key else None
        self.encoders = EncoderPool(
            config.encoder_urls,
            client,
            encode_session,
            metrics,
            config.eject_after_failures,
            config.encode_timeout_s,
            config.heartbeat_timeout_s,
            prover,
        )
        self.upstreams = Upstreams(config, session, metrics)
        self.inliner = MediaInliner(
            config.url_policy, config.media_limits, config.max_inline_bytes, config.max_inline_total_bytes
        )
        store = ImageStore(config.image_url_ttl_s, config.image_store_bytes) if config.image_urls else None
        self.images = (
            ImageGenerator(
                config.text_encoder_urls,
                config.geri_urls,
                unkeyed,
                config.upstream_api_key,
                config.geri_api_key,
                store,
                config.max_image_requests,
            )
            if config.geri_urls
            else None
        )
        self.serves_chat = bool(config.colocated_urls or (config.prefill_urls and config.decode_urls))
        self.plain_media = PlainMedia()

    def check_serves_chat(self) -> None:
        """404 when this gateway has no chat upstreams (it serves image generation only)."""
        if not self.serves_chat:
            raise ApiError(404, "this gateway serves image generation only (no chat upstreams)")

    def check_api_key(self, request: Request) -> None:
        """401 unless the request carries the gateway's API key (none configured: no check)."""
        if self.config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode()):
            raise ApiError(401, "Unauthorized")

    async def chat(self, raw: bytes | None, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, Response]:
        """A checked chat request, routed EPD (media encoded by the Erics) or plain: the path taken and the answer."""
        checking = time.perf_counter()
        check_request_fields(body, chat=True)
        check_messages(body, allow_embeddings=self.config.client_embeddings is not None)
        if self.config.client_embeddings is not None:  # base64 tensors decoded: off the event loop
            await asyncio.to_thread(check_embeds_parts, body, self.config.client_embeddings)
        refs = collect_media(body, self.config.url_policy, self.config.max_items, audio_in_video(body))
        if drop_inert_audio_in_video(body, any("video" in ref.modalities for ref in refs)):
            raw = None  # the body changed: forwarded re-encoded
        await check_hosts(self.inliner.resolve_host, remote_hosts(refs), self.config.media_limits.timeout_s)
        modalities = {m for ref in refs for m in ref.modalities}
        if "audio" in modalities:
            await self._check_takes_audio(body)
        start = time.perf_counter()
        self.metrics.stages.observe("validate", start - checking)
        plain = RawBody(self.inliner, body, raw, refs)  # what the engines' own path gets: never a URL
        try:
            return await self._route(plain, body, headers, refs, modalities)
        finally:
            plain.close()

    async def _route(
        self, plain: RawBody, body: dict[str, Any], headers: dict[str, str], refs: list[MediaRef], modalities: set[str]
    ) -> tuple[str, Response]:
        """EPD or the plain path for a checked request: the path taken and the answer."""
        start = time.perf_counter()
        if self.config.backend == "sglang":
            return await self._sglang_chat(plain, headers, refs)
        fresh = self.plain_media.unseen(refs)  # media the engine encoded on an earlier plain turn do not count
        if fresh < self.config.epd_min_items or not self.encoders.healthy():
            path = "pd" if fresh < self.config.epd_min_items else "fallback"
            return path, await self._plain(plain, headers)
        if not await self.encoders.serve(modalities):
            logger.info("the encoders do not encode every modality of this request; the engine encodes it")
            return "pd", await self._plain(plain, headers)
        async with self.encoders.leases() as leases:  # every lease back on leaving, unless the engine took them
            answer = await self._epd(plain, body, headers, refs, leases, start)
        return ("epd", answer) if answer is not None else ("fallback", await self._plain(plain, headers))

    async def _epd(
        self,
        plain: RawBody,
        body: dict[str, Any],
        headers: dict[str, str],
        refs: list[MediaRef],
        leases: Leases,
        start: float,
    ) -> Response | None:
        """The EPD path: the engine's answer, or None where the engine must encode the raw media itself (encoders
        unavailable, a video vLLM cannot place, embeddings lost upstream). Leases are `leases`' to give back."""
        try:
            sent, inlined = await self._as_encoded(plain, refs)
            items, fanout = await self.encoders.encode(sent, leases)
        except EncodersUnavailableError as e:
            logger.warning("encoders unavailable, falling back to the PD path with raw media: %s", e)
            return None
        # the same content under two URLs, or as an audio part and a soundtrack: one lease used, the others back
        await leases.give_back(spare_handles(items))
        encoded = time.perf_counter() - start
        self.metrics.encode_latency.observe(encoded)
        self.metrics.stages.observe("encode", encoded)
        self.metrics.fanout.observe(fanout)
        if not inlined and any(i.placement == MEDIA for i in items):  # Eric fetched what the engine won't
            logger.warning("an Eric placed items by their media although its card said otherwise; raw media instead")
            return None
        if not vllm_can_place(items):
            logger.info("a video's time spacing is not vLLM's default for metadata-only items; raw media instead")
            return None
        # items placed by their media keep them: the inlined body (fetched before encoding, see _as_encoded)
        source = (await plain.get())[0] if any(i.placement == MEDIA for i in items) else body
        start = time.perf_counter()
        rewritten = with_embeddings(source, refs, items)
        self.metrics.stages.observe("rewrite", time.perf_counter() - start)
        response = await self.upstreams.complete("/v1/chat/completions", rewritten, headers)
        if _embeddings_lost(response):
            # an encoder died between encode and the engine's fetch: the engine encodes the raw media instead
            logger.warning("EPD request lost its embeddings upstream; retrying with raw media")
            self.metrics.failovers.inc()
            return None
        if response.status_code < 400:
            leases.hand_over()  # the engine acknowledges what it fetched; a refused request's leases come back
        return response

    async def _as_encoded(self, plain: RawBody, refs: list[MediaRef]) -> tuple[list[MediaRef], bool]:
        """The refs to send the Erics, and whether they are inlined: the client's URLs, or where the engine may get
        the media itself (placement "media", the generic path, or an Eric whose card is unread) the data: URLs it
        will get, inlined here once (the same bytes encoded and sent)."""
        if not await self.encoders.places_media():
            return refs, False
        start = time.perf_counter()
        body, _ = await plain.get()
        self.metrics.stages.observe("inline", time.perf_counter() - start)
        return inlined_refs(body, refs), True

    async def _plain(self, plain: RawBody, headers: dict[str, str], sglang_epd: bool = False) -> Response:
        """The engines' own path: the request with its remote media fetched here and inlined as data: URLs."""
        start = time.perf_counter()
        body, raw = await plain.get()
        self.metrics.stages.observe("inline", time.perf_counter() - start)
        response = await self.upstreams.complete("/v1/chat/completions", body, headers, raw, sglang_epd=sglang_epd)
        if response.status_code < 400 and not sglang_epd:
            self.plain_media.remember(plain.refs)
        return response

    async def _sglang_chat(self, plain: RawBody, headers: dict[str, str], refs: list[MediaRef]) -> tuple[str, Response]:
        """SGLang: a --language-only prefill has its media encoded by the Erics (its --encoder-urls) itself, so
        the request goes there (media inlined, as everywhere an engine sees it); if that prefill fails, a plain
        prefill encodes the raw media. Audio items (`input_audio`, `audio_url`) count and go as images do: Eric's
        SGLang routes encode a model's audio, and a request with audio and images takes one path, whole. A video with
        its soundtrack (`use_audio_in_video`) takes the plain path: Eric's SGLang routes encode no soundtracks."""
        if (
            len(refs) < self.config.epd_min_items
            or not self.config.epd_prefill_urls
            or any(ref.with_audio for ref in refs)
        ):
            return "pd", await self._plain(plain, headers)
        try:
            response = await self._plain(plain, headers, sglang_epd=True)
        except ApiError as e:
            if e.status not in (502, 504) or not (self.config.prefill_urls or self.config.colocated_urls):
                raise
            response = None
            logger.warning("SGLang EPD prefill failed (%s); plain PD path", e.message)
        if response is not None and response.status_code < 500:
            return "epd", response
        if isinstance(response, StreamingResponse):
            await response.body_iterator.aclose()  # type: ignore[attr-defined]  # releases the upstream stream
        self.metrics.failovers.inc()
        return "fallback", await self._plain(plain, headers)

    async def _check_takes_audio(self, body: dict[str, Any]) -> None:
        """400 when the Erics' cards say the served model takes no audio (unknown: the engine's own answer tells)."""
        said = {member.takes_audio for member in await self.encoders.carded()} - {None}
        if said == {False}:
            raise ApiError(
                400,
                f"the model {body.get('model') or 'served here'!r} does not take audio "
                "(its input_audio or audio_url parts)",
                param="messages",
            )


def _embeddings_lost(response: Response) -> bool:
    """A non-streamed EPD answer that failed upstream (5xx, or vLLM's finish_reason "error")."""
    if response.status_code >= 500:
        return True
    if isinstance(response, StreamingResponse) or response.status_code != 200:
        return False
    try:
        choices = orjson.loads(response.body).get("choices", [])
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return any(c.get("finish_reason") == "error" for c in choices)
