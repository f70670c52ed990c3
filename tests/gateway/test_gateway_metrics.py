"""The gateway's per-stage and per-upstream timings (gateway_stage_seconds, gateway_upstream_seconds): real gateways
in front of one small aiohttp stand-in that plays an Eric (/v1/encode) and vLLM (prefill with kv_transfer_params,
decode, colocated), started by this test. Counts follow the calls made; no timing is asserted."""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from aiohttp import web
from epd_gateway.metrics import STAGES, UPSTREAMS

from eric_epd.stack.process import free_port
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages
from eric_epd.wire.eric import EncodeAnswer, EncodedItem
from eric_epd.wire.handles import EmbeddingHandle


def _stand_in() -> web.Application:
    """An Eric and a vLLM in one: encode answers keyed items, prefill answers kv_transfer_params, the rest text."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def encode(request: web.Request) -> web.Response:
        producer = f"http://{request.host}"
        items = []
        for item in (await request.json())["items"]:  # answered in Eric's own schema (wire.eric)
            key = hashlib.sha256(item["url"].encode()).hexdigest()
            handle = EmbeddingHandle(
                key,
                (4, 8),
                "float32",
                128,
                producer,
                "stand-in",
                f"{producer}/v1/embeddings/{key}",
                lease="lease-" + key[:8],
            )
            items.append(EncodedItem(item["id"], item["modality"], key, [4, 8], "float32", 4, [1, 4, 4], handle))
        return web.Response(body=msgspec.json.encode(EncodeAnswer("stand-in", items)), content_type="application/json")

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        answer = {
            "id": "chatcmpl-stand-in",
            "object": "chat.completion",
            "model": "stand-in",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        }
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = {"remote_engine_id": "stand-in", "remote_block_ids": [0]}
        return web.json_response(answer)

    async def card(_: web.Request) -> web.Response:  # an Eric whose engine places items by their grid
        return web.json_response(
            {"object": "list", "data": [{"id": "stand-in", "modalities": ["image"], "placement": "grid"}]}
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", card)
    app.router.add_post("/v1/encode", encode)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture(scope="module")
def stand_in() -> Iterator[str]:
    """The stand-in's base URL, served from a thread with its own event loop."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_stand_in())
    port = free_port()
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="gateway-stand-in", daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _chat(gateway: GatewayServer, messages: list[dict]) -> httpx.Response:
    resp = httpx.post(
        gateway.url + "/v1/chat/completions", json={"model": "stand-in", "messages": messages}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    return resp


def _histogram(text: str, family: str, label: str) -> dict[str, tuple[float, float]]:
    """label value -> (count, sum) of one histogram family in Prometheus text."""

    def samples(part: str) -> dict[str, float]:
        pattern = rf'^{family}_{part}\{{{label}="(\w+)"\}} (\S+)$'
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}

    counts, sums = samples("count"), samples("sum")
    return {value: (counts[value], sums[value]) for value in counts}


def _scrape(gateway: GatewayServer) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    text = httpx.get(gateway.url + "/metrics", headers=gateway.metrics_headers).text
    return (
        _histogram(text, "gateway_stage_seconds", "stage"),
        _histogram(text, "gateway_upstream_seconds", "upstream"),
    )


def test_stage_and_upstream_timings_follow_the_calls(stand_in: str, tmp_path: Path) -> None:
    images = image_messages([image_data_url(40, 40, seed=1), image_data_url(48, 40, seed=2)])
    text = [{"role": "user", "content": "Hi."}]
    with GatewayServer(
        tmp_path / "pd.log", "--encoder-urls", stand_in, "--prefill-urls", stand_in, "--decode-urls", stand_in
    ) as gateway:
        stages, upstreams = _scrape(gateway)
        assert set(stages) == set(STAGES) and set(upstreams) == set(UPSTREAMS)  # exported from the start
        assert all(count == 0 for count, _ in (*stages.values(), *upstreams.values()))
        assert _chat(gateway, images).headers["x-epd-path"] == "epd"  # encode, rewrite, prefill, decode
        assert _chat(gateway, text).headers["x-epd-path"] == "pd"  # prefill, decode
        stages, upstreams = _scrape(gateway)
    assert {stage: count for stage, (count, _) in stages.items()} == {
        "body_read": 2,
        "validate": 2,
        "encode": 1,
        "rewrite": 1,
        "inline": 1,
    }  # the text chat: nothing to inline
    assert {kind: count for kind, (count, _) in upstreams.items()} == {
        "encoder": 1,
        "prefill": 2,
        "decode": 2,
        "colocated": 0,
    }  # both images went to the one encoder
    assert all(total >= 0 for _, total in (*stages.values(), *upstreams.values()))
    assert stages["encode"][1] >= upstreams["encoder"][1] > 0  # the encode stage holds the call to the Eric

    with GatewayServer(tmp_path / "colocated.log", "--colocated-urls", stand_in) as gateway:
        _chat(gateway, text)
        _chat(gateway, image_messages([image_data_url(40, 40, seed=3)]))
        stages, upstreams = _scrape(gateway)
    assert {kind: count for kind, (count, _) in upstreams.items()} == {
        "encoder": 0,
        "prefill": 0,
        "decode": 0,
        "colocated": 2,
    }
    assert stages["body_read"][0] == stages["validate"][0] == 2 and stages["encode"][0] == 0
