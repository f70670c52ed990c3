"""Calls to the inference engines: colocated, or prefill then decode with the engine's KV-transfer parameters.

aiohttp, not httpx, on this hot path: measured here, an httpx hop added about 2 ms per request over aiohttp's."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from starlette.responses import Response, StreamingResponse

from epd_gateway.config import GatewayConfig
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.redact import for_client
from epd_gateway.stream import TimedStream
from eric_epd.common.errors import ApiError

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}
RETRY_ONCE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""A pooled keep-alive connection the server had closed: the request never reached it, so it is sent again."""


def pooled_session(timeout: aiohttp.ClientTimeout, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A pooled session to upstreams the gateway trusts (`headers` on every call). Idle connections are dropped
    before an upstream's keep-alive timeout (uvicorn's is 5 s) closes them under us."""
    connector = aiohttp.TCPConnector(limit=512, keepalive_timeout=2.0)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers, auto_decompress=False)


def new_session(config: GatewayConfig) -> aiohttp.ClientSession:
    """The engines' session, one per gateway process; sock_read bounds the wait for each chunk, not the whole
    (streamed) answer."""
    return pooled_session(aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=config.upstream_timeout_s))


@dataclass(frozen=True)
class Reply:
    """A whole upstream answer."""

    status: int
    body: bytes
    headers: dict[str, str]

    def response(self) -> Response:
        """As the client gets it: an upstream's 5xx text redacted (redact.py), anything else unchanged."""
        body = self.body
        if self.status >= 500:
            body = for_client(self.status, body.decode(errors="replace")).encode()
        return Response(body, self.status, headers=self.headers)


class Upstreams:
    """The inference engines behind the gateway, taken round-robin: colocated, or prefill then decode."""

    def __init__(self, config: GatewayConfig, session: aiohttp.ClientSession, metrics: GatewayMetrics) -> None:
        self._config = config
        self._session = session
        self._metrics = metrics
        self._colocated = itertools.cycle(config.colocated_urls) if config.colocated_urls else None
        self._prefill = itertools.cycle(config.prefill_urls) if config.prefill_urls else None
        self._decode = itertools.cycle(config.decode_urls) if config.decode_urls else None
        self._epd_prefill = itertools.cycle(config.epd_prefill_urls) if config.epd_prefill_urls else None
        # gateway_upstream_seconds label per call stage: a colocated instance answers the "decode" call
        self._kinds = {"prefill": "prefill", "decode": "colocated" if config.colocated_urls else "decode"}

    async def get(self, path: str, headers: dict[str, str]) -> Response:
        """A read-only call (e.g. /v1/models) answered by the first decode-capable upstream."""
        url = (self._config.colocated_urls or self._config.decode_urls)[0]
        try:
            async with self._session.get(url + path, headers=headers) as resp:
                return Reply(resp.status, await resp.read(), _headers(resp)).response()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise ApiError(503, f"upstream {url} unreachable: {e!r}") from e

    async def complete(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        raw: bytes | None = None,
        sglang_epd: bool = False,
    ) -> Response:
        """Run one (chat) completion to the end; streams when the client asked for it. `raw`, when given, is the
        client's unmodified body (forwarded without re-encoding). `sglang_epd`: prefill on an --epd-prefill-urls
        instance (SGLang --language-only, which has its media encoded by the Erics)."""
        if self._colocated is not None:
            if sglang_epd and self._epd_prefill is not None:  # a language-only SGLang that decodes too: its failure
                return await self._forward("prefill", next(self._epd_prefill), path, body, headers, raw)  # is a 502
            return await self._forward("decode", next(self._colocated), path, body, headers, raw)
        assert self._prefill is not None and self._decode is not None
        pool = self._epd_prefill if sglang_epd and self._epd_prefill is not None else self._prefill
        prefill_url, decode_url = next(pool), next(self._decode)
        if self._config.backend == "sglang":
            return await self._sglang(prefill_url, decode_url, path, body, headers)
        return await self._vllm_pd(prefill_url, decode_url, path, body, headers)

    async def _vllm_pd(
        self, prefill_url: str, decode_url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        """vLLM disaggregated prefill: one prefill token with do_remote_decode, then decode with the returned
        kv_transfer_params (remote block ids, host, port...). One prompt per request: vLLM returns the params of the
        first prompt only."""
        if _prompt_count(body.get("prompt")) > 1:
            raise ApiError(
                400,
                "one prompt per request on the prefill/decode path: send each prompt of the list as its own request",
                param="prompt",
            )
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        }
        for conflicting in ("max_completion_tokens", "stream_options", "min_tokens"):  # refused with max_tokens 1
            prefill_body.pop(conflicting, None)
        reply = await self._post("prefill", prefill_url, path, prefill_body, headers)
        if reply.status != 200:
            return reply.response()
        try:
            params = orjson.loads(reply.body).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            params = None
        if not params:
            self._metrics.failures.labels(stage="prefill").inc()
            raise ApiError(
                502,
                f"prefill at {prefill_url} returned no kv_transfer_params "
                "(is it started with a KV connector as kv_producer?)",
            )
        return await self._forward("decode", decode_url, path, {**body, "kv_transfer_params": params}, headers)

    async def _sglang(
        self, prefill_url: str, decode_url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        """SGLang PD: the same request to prefill and decode with one bootstrap room; decode's answer returns,
        unless prefill fails first (decode would only wait for KV that never comes): then a 502. A streamed decode
        sends its headers at once, so its stream is handed out only once the prefill has sent the KV; a caller's
        cancellation (its client left) cancels both calls."""
        room = random.getrandbits(63)
        host = urlsplit(prefill_url).hostname
        pd_body = {
            **body,
            "bootstrap_host": host,
            "bootstrap_port": self._config.sglang_bootstrap_port,
            "bootstrap_room": room,
        }
        prefill = asyncio.create_task(self._post("prefill", prefill_url, path, {**pd_body, "stream": False}, headers))
        decode = asyncio.create_task(self._forward("decode", decode_url, path, pd_body, headers))
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done() and _streaming(decode):
                await asyncio.wait({prefill})
        except BaseException:
            prefill.cancel()
            await _discard(decode)
            raise
        failure = _failure(prefill) if prefill.done() else None
        if failure is not None:
            await _discard(decode)
            self._metrics.failures.labels(stage="prefill").inc()
            raise ApiError(502, f"prefill at {prefill_url} failed: {failure}")
        if _answered(decode) and not _refused(decode):
            prefill.add_done_callback(_log_prefill)
        else:  # decode failed or refused the request: its prefill would send KV to nobody
            prefill.cancel()
        return await decode  # a cancellation here cancels the awaited decode too (the prefill is done or answered)

    async def _open(self, stage: str, url: str, content: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST and return the response with its headers read (the body is the caller's to read or relay); the
        time to the headers is observed per upstream kind."""
        headers = {**headers, "content-type": "application/json"}
        start = time.perf_counter()
        try:
            try:
                resp = await self._session.post(url, data=content, headers=headers)
            except RETRY_ONCE as e:
                logger.info("retrying %s on a fresh connection after %r", url, e)
                resp = await self._session.post(url, data=content, headers=headers)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._failed(stage, url, "unreachable", e) from e
        self._metrics.upstreams.observe(self._kinds[stage], time.perf_counter() - start)
        return resp

    async def _read(self, stage: str, url: str, resp: aiohttp.ClientResponse) -> Reply:
        try:
            async with resp:
                return Reply(resp.status, await resp.read(), _headers(resp))
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._failed(stage, url, "failed", e) from e

    def _failed(self, stage: str, url: str, what: str, e: BaseException) -> ApiError:
        """Count an upstream failure and name it: 504 for a timeout, else 502 for prefill and 503 for decode."""
        self._metrics.failures.labels(stage=stage).inc()
        if isinstance(e, asyncio.TimeoutError):
            return ApiError(504, f"{stage} at {url} timed out")
        return ApiError(502 if stage == "prefill" else 503, f"{stage} at {url} {what}: {e!r}")

    async def _post(self, stage: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> Reply:
        resp = await self._open(stage, url + path, orjson.dumps(body), headers)
        return await self._read(stage, url, resp)

    async def _forward(
        self, stage: str, url: str, path: str, body: dict[str, Any], headers: dict[str, str], raw: bytes | None = None
    ) -> Response:
        """The final call; its response (streamed or not) goes back to the client unchanged."""
        resp = await self._open(stage, url + path, raw if raw is not None else orjson.dumps(body), headers)
        if resp.status >= 500:
            self._metrics.failures.labels(stage=stage).inc()
        if not body.get("stream") or resp.status >= 500:  # an error is read whole, to be redacted
            return (await self._read(stage, url, resp)).response()
        return TimedStream(_Relay(resp), resp.status, _headers(resp), self._config.stream_write_timeout_s)


def _prompt_count(prompt: Any) -> int:
    """How many prompts a /v1/completions `prompt` holds: a string or a list of token ids is one; a list of strings
    or of token-id lists is one per item (absent, as in a chat request: one)."""
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


def _failure(prefill: asyncio.Task[Reply]) -> str | None:
    """Why a finished SGLang prefill call failed (an exception or a 5xx), or None."""
    if prefill.cancelled():
        return "cancelled"
    if (e := prefill.exception()) is not None:
        return e.message if isinstance(e, ApiError) else repr(e)
    reply = prefill.result()
    return f"HTTP {reply.status}: {reply.body[:200]!r}" if reply.status >= 500 else None


def _log_prefill(prefill: asyncio.Task[Reply]) -> None:
    if (failure := _failure(prefill)) is not None:
        logger.warning("SGLang prefill failed after decode answered: %s", failure)


def _streaming(decode: asyncio.Task[Response]) -> bool:
    """A decode call that returned a stream (its headers), which may still be waiting for its KV."""
    return (
        decode.done()
        and not decode.cancelled()
        and decode.exception() is None
        and isinstance(decode.result(), StreamingResponse)
    )


def _answered(decode: asyncio.Task[Response]) -> bool:
    """A decode call that is still running or answered below 500 (an exception or a 5xx is a failure)."""
    if not decode.done():
        return True
    return not decode.cancelled() and decode.exception() is None and decode.result().status_code < 500


def _refused(decode: asyncio.Task[Response]) -> bool:
    """A decode call that answered, whole, with an error (a 4xx here): it will take no KV."""
    return decode.done() and not _streaming(decode) and decode.result().status_code >= 400


async def _discard(decode: asyncio.Task[Response]) -> None:
    """Cancel a decode call, closing its upstream stream if it had one."""
    decode.cancel()
    try:
        response = await decode
    except (asyncio.CancelledError, Exception):
        return
    if isinstance(response, StreamingResponse):
        await response.body_iterator.aclose()  # type: ignore[attr-defined]


class _Relay:
    """A StreamingResponse's body from an upstream stream; closing it releases the upstream response even when no
    chunk was read (an async generator closed before its first step never runs its `finally`)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._chunks = _relay(resp)

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        self._resp.close()


async def _relay(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Pass an upstream stream (SSE) through chunk by chunk; a broken upstream ends the stream."""
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except (TimeoutError, aiohttp.ClientError) as e:
        logger.warning("upstream stream from %s broke: %r", resp.url, e)
    finally:
        resp.release()


def _headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
