"""The engine middlewares in the order `vllm serve --middleware` stacks them (the last given outermost): an unkeyed
caller's chat body is never read, whatever the order; a keyed one's metadata-only part is a 400 and a good body
reaches the app byte for byte (Starlette's own middleware stacking, the real middleware classes)."""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from eric_epd.common.errors import OFF_LOOP_BYTES
from eric_epd.plugins.vllm.auth import RequireEngineKey
from eric_epd.plugins.vllm.middleware import RefuseUnkeyedMetadata

KEY = "engine-key"
GRID_ONLY = {
    "messages": [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}}]}]
}


def _client(order: tuple[type, ...], reads: list[int]) -> TestClient:
    async def chat(request: Request) -> JSONResponse:
        body = await request.body()
        reads.append(len(body))
        return JSONResponse({"got": len(body)})

    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])], middleware=[Middleware(cls) for cls in order]
    )
    return TestClient(app)


@pytest.mark.parametrize(
    "order",
    [(RequireEngineKey, RefuseUnkeyedMetadata), (RefuseUnkeyedMetadata, RequireEngineKey), (RefuseUnkeyedMetadata,)],
)
def test_the_key_is_checked_before_any_body_is_read(order: tuple[type, ...], monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    reads: list[int] = []
    client = _client(order, reads)
    streamed: list[int] = []

    def body():
        for _ in range(64):
            streamed.append(1)
            yield b"[" * 65536

    unkeyed = client.post("/v1/chat/completions", content=body())
    assert unkeyed.status_code == 401 and "engine key" in unkeyed.json()["error"]["message"]
    assert reads == [] and len(streamed) <= 2  # 4 MiB offered, at most the first chunk taken before the 401
    refused = client.post("/v1/chat/completions", json=GRID_ONLY, headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 400 and "needs a 'uuid'" in refused.json()["error"]["message"]
    good = dict(
        GRID_ONLY,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "abc"}],
            }
        ],
    )
    ok = client.post("/v1/chat/completions", json=good, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and reads == [len(ok.request.content)] and ok.json()["got"] > 0


def test_without_the_key_check_the_body_would_be_read(monkeypatch) -> None:
    """Negative control: a route behind no key check reads the whole unkeyed body."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    reads: list[int] = []
    client = _client((), reads)
    assert client.post("/v1/chat/completions", content=b"[" * 100_000).status_code == 200 and reads == [100_000]


def test_a_metadata_only_part_is_refused_however_it_is_spelled_and_large_bodies_too(monkeypatch) -> None:
    """The middleware parses only a body that can hold an embeds part: one whose type is spelled with JSON \\u escapes
    or in UTF-16 or UTF-32 is parsed and refused all the same, as is one past OFF_LOOP_BYTES (parsed off the event
    loop); a body naming no embeds part reaches the app unparsed, byte for byte."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    reads: list[int] = []
    client = _client((RefuseUnkeyedMetadata,), reads)
    keyed = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    escaped = b'{"messages": [{"role": "user", "content": [{"type": "image\\u005fembeds", "image\\u005fembeds": {}}]}]}'
    refused = client.post("/v1/chat/completions", content=escaped, headers=keyed)
    assert refused.status_code == 400 and "needs a 'uuid'" in refused.json()["error"]["message"]
    for encoding in ("utf-16", "utf-32-le", "utf-8-sig"):  # json.loads reads them all, as vLLM's route does
        spelled = json.dumps(GRID_ONLY).encode(encoding)
        refused = client.post("/v1/chat/completions", content=spelled, headers=keyed)
        assert refused.status_code == 400 and "needs a 'uuid'" in refused.json()["error"]["message"], encoding
    padded = {**GRID_ONLY, "padding": "x" * (OFF_LOOP_BYTES + 1)}
    refused = client.post("/v1/chat/completions", json=padded, headers=keyed)
    assert refused.status_code == 400 and "needs a 'uuid'" in refused.json()["error"]["message"]
    plain = b'{"messages": [{"role": "user", "content": "hi"}], "padding": "' + b"y" * OFF_LOOP_BYTES + b'"}'
    ok = client.post("/v1/chat/completions", content=plain, headers=keyed)
    assert ok.status_code == 200 and reads == [len(plain)]
