"""Calls to the inference engines: colocated, or prefill then decode with the engine's KV-transfer parameters."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from fastapi.responses import Response, StreamingResponse

from epd_gateway.config import GatewayConfig
from epd_gateway.errors import GatewayError
from epd_gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class Upstreams:
    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient, metrics: GatewayMetrics) -> None:
        self._config = config
        self._client = client
        self._metrics = metrics
        self._colocated = itertools.cycle(config.colocated_urls) if config.colocated_urls else None
        self._prefill = itertools.cycle(config.prefill_urls) if config.prefill_urls else None
        self._decode = itertools.cycle(config.decode_urls) if config.decode_urls else None
        self._epd_prefill = itertools.cycle(config.epd_prefill_urls) if config.epd_prefill_urls else None

    async def get(self, path: str, headers: dict[str, str]) -> Response:
        """A read-only call (e.g. /v1/models) answered by the first decode-capable upstream."""
        url = (self._config.colocated_urls or self._config.decode_urls)[0]
        try:
            resp = await self._client.get(url + path, headers=headers)
        except httpx.HTTPError as e:
            raise GatewayError(503, f"upstream {url} unreachable: {e!r}") from e
        return _passthrough(resp)

    async def complete(self, path: str, body: dict[str, Any], headers: dict[str, str],
                       raw: bytes | None = None, sglang_epd: bool = False) -> Response:
        """Run one (chat) completion to the end; streams when the client asked for it. `raw`, when given, is the
        client's unmodified body (forwarded without re-encoding). `sglang_epd`: prefill on an --epd-prefill-urls
        instance (SGLang --language-only, which has its media encoded by the Erics)."""
        if self._colocated is not None:
            return await self._forward("decode", next(self._colocated), path, body, headers, raw)
        assert self._prefill is not None and self._decode is not None
        pool = self._epd_prefill if sglang_epd and self._epd_prefill is not None else self._prefill
        prefill_url, decode_url = next(pool), next(self._decode)
        if self._config.backend == "sglang":
            return await self._sglang(prefill_url, decode_url, path, body, headers)
        return await self._vllm_pd(prefill_url, decode_url, path, body, headers)

    async def _vllm_pd(self, prefill_url: str, decode_url: str, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> Response:
        """vLLM disaggregated prefill: one prefill token with do_remote_decode, then decode with the returned
        kv_transfer_params (remote block ids, host, port...)."""
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                               "remote_engine_id": None, "remote_block_ids": None,
                                               "remote_host": None, "remote_port": None}}
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        resp = await self._post("prefill", prefill_url, path, prefill_body, headers)
        if resp.status_code != 200:
            return _passthrough(resp)
        params = resp.json().get("kv_transfer_params")
        if not params:
            self._metrics.failures.labels(stage="prefill").inc()
            raise GatewayError(502, f"prefill at {prefill_url} returned no kv_transfer_params "
                                    "(is it started with a KV connector as kv_producer?)")
        return await self._forward("decode", decode_url, path, {**body, "kv_transfer_params": params}, headers)

    async def _sglang(self, prefill_url: str, decode_url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str]) -> Response:
        """SGLang PD: the same request to prefill and decode with one bootstrap room; decode's answer returns,
        unless prefill fails first (decode would only wait for KV that never comes): then a 502."""
        room = random.getrandbits(63)
        host = urlsplit(prefill_url).hostname
        pd_body = {**body, "bootstrap_host": host, "bootstrap_port": self._config.sglang_bootstrap_port,
                   "bootstrap_room": room}
        prefill = asyncio.create_task(self._post("prefill", prefill_url, path, {**pd_body, "stream": False}, headers))
        decode = asyncio.create_task(self._forward("decode", decode_url, path, pd_body, headers))
        await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        failure = _failure(prefill) if prefill.done() else None
        if failure is not None:
            await _discard(decode)
            self._metrics.failures.labels(stage="prefill").inc()
            raise GatewayError(502, f"prefill at {prefill_url} failed: {failure}")
        prefill.add_done_callback(_log_prefill)
        return await decode

    async def _send(self, request: httpx.Request, stream: bool) -> httpx.Response:
        """Send once more if a pooled keep-alive connection turned out to be closed by the server (the request
        never reached it); any other failure propagates."""
        try:
            return await self._client.send(request, stream=stream)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            logger.info("retrying %s on a fresh connection after %r", request.url, e)
            return await self._client.send(request, stream=stream)

    async def _post(self, stage: str, url: str, path: str, body: dict[str, Any],
                    headers: dict[str, str]) -> httpx.Response:
        request = self._client.build_request("POST", url + path, content=orjson.dumps(body),
                                             headers={**headers, "content-type": "application/json"},
                                             timeout=self._config.upstream_timeout_s)
        try:
            return await self._send(request, stream=False)
        except httpx.TimeoutException as e:
            self._metrics.failures.labels(stage=stage).inc()
            raise GatewayError(504, f"{stage} at {url} timed out") from e
        except httpx.HTTPError as e:
            self._metrics.failures.labels(stage=stage).inc()
            raise GatewayError(502 if stage == "prefill" else 503, f"{stage} at {url} unreachable: {e!r}") from e

    async def _forward(self, stage: str, url: str, path: str, body: dict[str, Any],
                       headers: dict[str, str], raw: bytes | None = None) -> Response:
        """The final call; its response (streamed or not) goes back to the client unchanged."""
        content = raw if raw is not None else orjson.dumps(body)
        request = self._client.build_request("POST", url + path, content=content,
                                             headers={**headers, "content-type": "application/json"},
                                             timeout=self._config.upstream_timeout_s)
        try:
            resp = await self._send(request, stream=True)
        except httpx.TimeoutException as e:
            self._metrics.failures.labels(stage=stage).inc()
            raise GatewayError(504, f"{stage} at {url} timed out") from e
        except httpx.HTTPError as e:
            self._metrics.failures.labels(stage=stage).inc()
            raise GatewayError(503, f"{stage} at {url} unreachable: {e!r}") from e
        if resp.status_code >= 500:
            self._metrics.failures.labels(stage=stage).inc()
        if not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code, headers=_headers(resp))
        return StreamingResponse(_relay(resp), resp.status_code, headers=_headers(resp))


def _failure(prefill: asyncio.Task[httpx.Response]) -> str | None:
    """Why a finished SGLang prefill call failed (an exception or a 5xx), or None."""
    if prefill.cancelled():
        return "cancelled"
    if (e := prefill.exception()) is not None:
        return e.message if isinstance(e, GatewayError) else repr(e)
    resp = prefill.result()
    return f"HTTP {resp.status_code}: {resp.text[:200]}" if resp.status_code >= 500 else None


def _log_prefill(prefill: asyncio.Task[httpx.Response]) -> None:
    if (failure := _failure(prefill)) is not None:
        logger.warning("SGLang prefill failed after decode answered: %s", failure)


async def _discard(decode: asyncio.Task[Response]) -> None:
    """Cancel a decode call, closing its upstream stream if it had one."""
    decode.cancel()
    try:
        response = await decode
    except (asyncio.CancelledError, GatewayError):
        return
    if isinstance(response, StreamingResponse):
        await response.body_iterator.aclose()  # type: ignore[attr-defined]


async def _relay(resp: httpx.Response):  # -> AsyncIterator[bytes]
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()


def _headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}


def _passthrough(resp: httpx.Response) -> Response:
    return Response(resp.content, resp.status_code, headers=_headers(resp))


