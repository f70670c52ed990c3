"""The gateway's engine-facing calls (epd_gateway/upstream.py) against in-process aiohttp stand-ins: SGLang PD
calls cancelled with their client or a decode's refusal, a streamed SGLang decode whose prefill fails, vLLM PD's
prefill body and its one-prompt rule, and /v1/completions cancelled when its client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from epd_gateway.config import GatewayConfig
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.routes import GatewayRoutes
from epd_gateway.upstream import Upstreams, new_session
from starlette.requests import Request
from starlette.responses import StreamingResponse

from eric_epd.common.errors import ApiError

ANSWER = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}
KV = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}
WAIT_S = 10.0  # a bound on waits for what must happen, never a measured duration


class Engine:
    """One engine stand-in: `answer(body)` makes each answer; records the bodies, the calls that started, and the
    calls whose client went away before they finished."""

    def __init__(self, answer: Callable[[web.Request, dict], Awaitable[web.StreamResponse]]) -> None:
        self.answer, self.bodies = answer, []
        self.started, self.left = asyncio.Event(), asyncio.Event()
        app = web.Application()
        app.router.add_post("/{path:.*}", self._handle)
        self.server = TestServer(app)  # handler_cancellation: a call's client closing it cancels its handler

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.started.set()
        try:
            return await self.answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.left.set()
            raise

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def never(request: web.Request, body: dict) -> web.StreamResponse:
    """An engine still working (a decode waiting for KV, a long prefill) when the caller leaves."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def headers_then_never(request: web.Request, body: dict) -> web.StreamResponse:
    """A streamed SGLang decode: headers at once, then its tokens only once the KV came (here never)."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def answers(request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response({**ANSWER, "kv_transfer_params": KV})


async def run(backend: str, prefill: Engine, decode: Engine, calls: Callable[[Upstreams], Awaitable[Any]]) -> Any:
    """`calls(upstreams)` with the gateway's upstream client over the two stand-ins."""
    async with prefill.server, decode.server:
        config = GatewayConfig(backend=backend, prefill_urls=(prefill.url,), decode_urls=(decode.url,))
        async with new_session(config) as session:
            return await calls(Upstreams(config, session, GatewayMetrics()))


def chat(stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


@pytest.mark.parametrize(
    ("stream", "decode_answer"),
    [(False, never), (True, never), (True, headers_then_never)],
    ids=["decode-working", "streamed-decode-working", "decode-streaming"],
)
def test_sglang_calls_are_cancelled_with_their_caller(stream: bool, decode_answer) -> None:
    prefill, decode = Engine(never), Engine(decode_answer)

    async def calls(upstreams: Upstreams) -> bool:
        call = asyncio.create_task(upstreams.complete("/v1/chat/completions", chat(stream), {}))
        await asyncio.wait_for(asyncio.gather(prefill.started.wait(), decode.started.wait()), WAIT_S)
        await asyncio.sleep(0.05)  # the decode's headers, when it sends them, reach the gateway
        call.cancel()  # what until_disconnect does when the client leaves
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(prefill.left.wait(), decode.left.wait()), WAIT_S)
        return call.cancelled()

    assert asyncio.run(run("sglang", prefill, decode, calls)) is True


def test_streamed_sglang_decode_is_not_handed_out_before_its_prefill_fails() -> None:
    decode = Engine(headers_then_never)

    async def failing_prefill(request: web.Request, body: dict) -> web.StreamResponse:
        await decode.started.wait()  # real SGLang: the decode's headers come before the prefill's answer
        await asyncio.sleep(0.05)
        return web.json_response({"object": "error", "message": "prefill failing"}, status=500)

    prefill = Engine(failing_prefill)

    async def calls(upstreams: Upstreams) -> int:
        try:
            response = await upstreams.complete("/v1/chat/completions", chat(True), {})
        except ApiError as e:
            await asyncio.wait_for(decode.left.wait(), WAIT_S)  # the decode's stream was closed
            return e.status
        if isinstance(response, StreamingResponse):
            await response.body_iterator.aclose()  # type: ignore[attr-defined]
        return response.status_code

    assert asyncio.run(run("sglang", prefill, decode, calls)) == 502


def test_streamed_sglang_decode_is_handed_out_once_its_prefill_answered() -> None:
    async def streams(request: web.Request, body: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await prefill.started.wait()
        await response.write(b"data: [DONE]\n\n")
        return response

    prefill, decode = Engine(answers), Engine(streams)

    async def calls(upstreams: Upstreams) -> tuple[int, bytes]:
        response = await upstreams.complete("/v1/chat/completions", chat(True), {})
        assert isinstance(response, StreamingResponse)
        return response.status_code, b"".join([chunk async for chunk in response.body_iterator])

    assert asyncio.run(run("sglang", prefill, decode, calls)) == (200, b"data: [DONE]\n\n")
    assert prefill.bodies[0]["bootstrap_room"] == decode.bodies[0]["bootstrap_room"]


def test_an_sglang_decode_refusing_the_request_ends_its_prefill() -> None:
    async def refuses(request: web.Request, body: dict) -> web.StreamResponse:
        return web.json_response({"object": "error", "message": "bad sampling params"}, status=400)

    prefill, decode = Engine(never), Engine(refuses)

    async def calls(upstreams: Upstreams) -> int:
        response = await upstreams.complete("/v1/chat/completions", chat(False), {})
        await asyncio.wait_for(prefill.left.wait(), WAIT_S)  # not left holding its bootstrap room for minutes
        return response.status_code

    assert asyncio.run(run("sglang", prefill, decode, calls)) == 400


def test_vllm_prefill_body_drops_what_conflicts_with_its_one_token() -> None:
    prefill, decode = Engine(answers), Engine(answers)
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "min_tokens": 4, "stream": False}

    async def calls(upstreams: Upstreams) -> int:
        return (await upstreams.complete("/v1/completions", body, {})).status_code

    assert asyncio.run(run("vllm", prefill, decode, calls)) == 200
    assert prefill.bodies[0]["max_tokens"] == 1 and "min_tokens" not in prefill.bodies[0]
    assert decode.bodies[0]["min_tokens"] == 4 and decode.bodies[0]["kv_transfer_params"] == KV


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]], ids=["strings", "token-lists"])
def test_vllm_pd_refuses_several_prompts_in_one_request(prompt: list) -> None:
    prefill, decode = Engine(answers), Engine(answers)

    async def calls(upstreams: Upstreams) -> ApiError:
        with pytest.raises(ApiError) as refused:
            await upstreams.complete("/v1/completions", {"model": "m", "prompt": prompt}, {})
        return refused.value

    refused = asyncio.run(run("vllm", prefill, decode, calls))
    assert refused.status == 400 and "one prompt per request on the prefill/decode path" in refused.message
    assert prefill.bodies == [] and decode.bodies == []


@pytest.mark.parametrize(
    "prompt", ["a", [1, 2, 3], ["a"], [[1, 2]]], ids=["string", "token-ids", "one-string", "one-token-list"]
)
def test_vllm_pd_takes_one_prompt_in_any_form(prompt: Any) -> None:
    prefill, decode = Engine(answers), Engine(answers)

    async def calls(upstreams: Upstreams) -> int:
        return (await upstreams.complete("/v1/completions", {"model": "m", "prompt": prompt}, {})).status_code

    assert asyncio.run(run("vllm", prefill, decode, calls)) == 200
    assert decode.bodies[0]["prompt"] == prompt


class _Gateway:
    """What the completions route needs of a Gateway: its upstream call never answers, and records being cancelled."""

    def __init__(self) -> None:
        self.upstreams, self.cancelled = self, asyncio.Event()

    def check_api_key(self, request: Request) -> None:
        pass

    def check_serves_chat(self) -> None:
        pass

    async def complete(self, *args: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_completion_is_cancelled_when_its_client_leaves() -> None:
    messages = [{"type": "http.request", "body": orjson.dumps({"model": "m", "prompt": "hi"}), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(0.05)  # the client leaves after sending its request
        return {"type": "http.disconnect"}

    async def leave() -> tuple[int, bool]:
        gateway = _Gateway()
        config = GatewayConfig(colocated_urls=("http://127.0.0.1:9",))
        routes = GatewayRoutes(config, GatewayMetrics(), lambda: gateway)  # type: ignore[arg-type,return-value]
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
        }
        response = await asyncio.wait_for(routes.completions(Request(scope, receive)), WAIT_S)
        return response.status_code, gateway.cancelled.is_set()

    assert asyncio.run(leave()) == (499, True)
