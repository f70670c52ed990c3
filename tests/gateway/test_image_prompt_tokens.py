"""The image path asks the text encoder for at most the tokens whose states Qwen-Image keeps (the template's 34 and
512 more: the encoder is causal, so those rows see nothing later), whatever the prompt's length; against an
in-process stand-in text encoder that records what it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from aiohttp import web
from epd_gateway.images import TEMPLATE_TOKENS, ImageGenerator

from eric_epd.common.errors import ApiError
from eric_epd.wire.geri import MAX_PROMPT_TOKENS
from tests.support.aiohttp_standin import serving

HIDDEN = 4


@asynccontextmanager
async def _text_encoder(prompt_tokens: int) -> AsyncIterator[tuple[str, list[dict]]]:
    """/tokenize answers `prompt_tokens` ids (0, 1, ...); /pooling one row per id it got: row i is [i] * HIDDEN."""
    pooled: list[dict] = []

    async def tokenize(_: web.Request) -> web.Response:
        return web.json_response({"count": prompt_tokens, "max_model_len": 10**6, "tokens": list(range(prompt_tokens))})

    async def pooling(request: web.Request) -> web.Response:
        body = await request.json()
        pooled.append(body)
        return web.json_response({"data": [{"data": [[float(i)] * HIDDEN for i in body["input"]]}]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/pooling", pooling)
    async with serving(app) as url:
        yield url, pooled


def _states(prompt_tokens: int) -> tuple[list[float], list[dict]]:
    async def run() -> tuple[list[float], list[dict]]:
        async with _text_encoder(prompt_tokens) as (url, pooled), httpx.AsyncClient() as client:
            states = await ImageGenerator((url,), ("http://geri.invalid",), client, None, None).hidden_states("p")
            return states[:, 0].tolist(), pooled

    return asyncio.run(run())


def test_a_long_prompt_is_encoded_only_as_far_as_its_kept_rows() -> None:
    kept, pooled = _states(5000)  # thousands of tokens: what CJK or emoji within MAX_PROMPT_CHARS can come to
    assert pooled[0]["input"] == list(range(TEMPLATE_TOKENS + MAX_PROMPT_TOKENS))
    assert kept == [float(i) for i in range(TEMPLATE_TOKENS, TEMPLATE_TOKENS + MAX_PROMPT_TOKENS)]


def test_a_short_prompt_is_encoded_whole() -> None:
    kept, pooled = _states(TEMPLATE_TOKENS + 20)  # the control: nothing cut
    assert pooled[0]["input"] == list(range(TEMPLATE_TOKENS + 20))
    assert kept == [float(i) for i in range(TEMPLATE_TOKENS, TEMPLATE_TOKENS + 20)]


def test_image_generations_past_the_bound_get_a_503_and_the_bound_frees_as_they_end() -> None:
    """At most `max_requests` generations are in progress (each holds up to MAX_IMAGES + 2 pooled connections, shared
    with the Erics' membership proofs): one more is a 503 with Retry-After at once; when one ends, the next is
    admitted. A stand-in text encoder holds /tokenize until released."""

    async def run() -> None:
        release = asyncio.Event()

        async def tokenize(_: web.Request) -> web.Response:
            await release.wait()
            return web.json_response({"error": {"message": "stand-in refuses"}}, status=500)

        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        async with serving(app) as url, httpx.AsyncClient() as client:
            images = ImageGenerator((url,), ("http://127.0.0.1:9",), client, None, None, max_requests=2)
            body = b'{"model": "m", "prompt": "a cat"}'
            held = [asyncio.create_task(images.generate(body, "http://gw")) for _ in range(2)]
            await asyncio.sleep(0.05)  # both in progress, waiting at the text encoder
            with pytest.raises(ApiError) as refused:
                await images.generate(body, "http://gw")
            assert refused.value.status == 503 and refused.value.retry_after == 1.0
            assert "--max-image-requests" in refused.value.message
            release.set()
            for task in held:  # they end (the stand-in's 500 is a 503 of theirs), and free the bound
                with pytest.raises(ApiError, match="text encoder answered 500"):
                    await task
            with pytest.raises(ApiError, match="text encoder answered 500"):  # admitted now, not refused
                await images.generate(body, "http://gw")

    asyncio.run(run())
