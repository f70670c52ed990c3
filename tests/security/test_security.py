"""A hostile client against the real stack (gateway -> Eric -> vLLM with the Eric connector): every attack is refused
with a 4xx naming the problem, the victim's answers stay the same, and every server goes on serving."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import openai
import pytest
import torch
from epd_gateway.boundary import STEERING_FIELDS

from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages
from eric_epd.wire.handles import LEASE_HEADER, EmbeddingHandle
from eric_epd.wire.handoff import handles_xargs

VICTIM = [image_data_url(96, 64, seed=700), image_data_url(72, 88, seed=701)]
ATTACKER = image_data_url(80, 80, seed=702)
STEERING = (*sorted(STEERING_FIELDS), "mm_payload", "return_mm_kwargs", "session_id", "a_field_from_the_future")
"""Every field boundary.py names as steering, and fields vLLM takes that no allowlist names (or none yet does)."""


@pytest.fixture(scope="module")
def stack(vllm_behind_erics, qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """A strict gateway (the default) and one that accepts client embeddings, over the session's Erics and vLLM."""
    logs = tmp_path_factory.mktemp("security")
    erics, vllm = vllm_behind_erics["erics"], vllm_behind_erics["vllm"]
    common = ("--encoder-urls", ",".join(e.url for e in erics), "--colocated-urls", vllm.url)
    keys = {"eric_api_key": vllm_behind_erics["eric_key"], "upstream_api_key": vllm.api_key}
    strict = GatewayServer(logs / "strict.log", *common, **keys).start()
    trusting = GatewayServer(
        logs / "trusting.log", *common, "--allow-client-embeddings", str(qwen2_vl_tiny), **keys
    ).start()
    yield {"strict": strict, "trusting": trusting, "erics": erics, "vllm": vllm}
    for gateway in (strict, trusting):
        gateway.stop()


def answer(url: str, messages: list[dict], key: str = "unused") -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs, through the openai client."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return resp.choices[0].token_ids, [t.logprob for t in resp.choices[0].logprobs.content]


def post(url: str, body: dict) -> httpx.Response:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "max_tokens": 4, **body}, timeout=60)


def refused(resp: httpx.Response, *words: str) -> None:
    """A 4xx in the JSON error shape whose message names every one of `words`."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    message = resp.json()["error"]["message"]
    assert all(w in message for w in words), message


def victim_hashes(stack) -> list[str]:
    """What an attacker computes offline from the victim's image (here: asked of Eric, with the internal key)."""
    eric = stack["erics"][1]
    items = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=60,
        json={"items": [{"modality": "image", "url": u} for u in VICTIM]},
    ).json()["items"]
    for item in items:  # give the leases back: the attacker only wanted the hashes
        httpx.post(
            f"{eric.url}/v1/embeddings/{item['hash']}/ack",
            headers={**eric.headers, LEASE_HEADER: item["handle"]["lease"]},
        )
    return [item["hash"] for item in items]


def test_client_identifiers_refused_and_victim_unchanged(stack) -> None:
    gw = stack["strict"].url
    tokens, logprobs = answer(gw, image_messages(VICTIM))
    target = victim_hashes(stack)[0]
    grid = {"image_grid_thw": [1, 4, 4]}
    attacks = [  # each would key the attacker's content (or none) under the victim's identifier
        ([{"type": "image_url", "image_url": {"url": ATTACKER}, "uuid": target}], ("uuid",)),
        ([{"type": "image_embeds", "image_embeds": grid, "uuid": target}], ("image_embeds",)),
        ([{"type": "text", "text": "x", "image_url": {"url": ATTACKER}, "uuid": target}], ("uuid",)),
        ([{"type": "text", "text": "x", "image_url": {"url": ATTACKER}}], ("image_url",)),
        ([{"type": "image_url", "image_url": {"url": ATTACKER, "uuid": target}}], ("uuid",)),
    ]
    for parts, words in attacks:
        refused(post(gw, {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}), *words)
    refused(
        post(
            stack["trusting"].url,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_embeds", "image_embeds": grid, "uuid": target}]}
                ]
            },
        ),
        "uuid",
    )
    # forged handles beside the request: refused as a steering field, never reach vLLM's connector
    forged = handles_xargs(
        [
            {
                "hash": target,
                "shape": [4, 8],
                "dtype": "float32",
                "nbytes": 128,
                "lease": "x",
                "producer": "http://10.0.0.1:1",
                "instance_id": "x",
                "http": "x",
            }
        ]
    )
    refused(post(gw, {"messages": image_messages(VICTIM), "vllm_xargs": forged}), "vllm_xargs")
    after_tokens, after_logprobs = answer(gw, image_messages(VICTIM))
    assert after_tokens == tokens
    assert after_logprobs == pytest.approx(logprobs, abs=1e-3)


def test_urls_anywhere_go_through_the_policy(stack) -> None:
    gw = stack["strict"].url
    loopback = "http://127.0.0.2:9/secret.png"  # not on the gateway's --allowed-host list
    refused(post(gw, {"messages": image_messages([loopback])}), "private")
    refused(
        post(
            gw,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x", "image_url": {"url": loopback}}]}
                ]
            },
        ),
        "image_url",
    )
    refused(
        post(
            stack["trusting"].url,
            {"messages": [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": {"url": loopback}}]}]},
        ),
        "image_embeds",
    )
    refused(post(gw, {"messages": [{"role": "user", "content": "hi", "image_url": loopback}]}), "image_url")


def test_steering_fields_refused_on_chat_and_completions(stack) -> None:
    """Each field of STEERING_FIELDS, and unlisted ones, sent to the real stack on both routes."""
    gw = stack["strict"].url
    for name in STEERING:
        refused(post(gw, {"messages": [{"role": "user", "content": "hi"}], name: {"x": 1}}), name)
        resp = httpx.post(gw + "/v1/completions", json={"model": "m", "prompt": "hi", name: {"x": 1}})
        refused(resp, name)
    refused(
        httpx.post(gw + "/v1/completions", json={"model": "m", "prompt": "hi", "prompt_embeds": "AAAA"}),
        "prompt_embeds",
    )


def _embeds_part(rows: int, width: int, grid: list[int]) -> dict:
    buffer = io.BytesIO()
    torch.save(torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)), buffer)
    data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_embeds", "image_embeds": {"image_embeds": data, "image_grid_thw": grid}}


def test_wrong_shape_embeddings_refused_engine_keeps_serving(stack, qwen2_vl_tiny: Path) -> None:
    """The request that killed vLLM's engine (fewer rows than its grid implies) is a 400 at the gateway; a right
    one from a trusted caller answers, and so does the next ordinary request."""
    width = json.loads((qwen2_vl_tiny / "config.json").read_text())["text_config"]["hidden_size"]
    grid = [1, 4, 4]  # 16 patches, merged 2x2: 4 rows
    trusting, strict = stack["trusting"].url, stack["strict"].url
    for rows, w in ((3, width), (5, width), (4, width + 1)):
        refused(
            post(trusting, {"messages": [{"role": "user", "content": [_embeds_part(rows, w, grid)]}]}),
            "image_embeds",
            "[4, ",
        )
    refused(
        post(strict, {"messages": [{"role": "user", "content": [_embeds_part(4, width, grid)]}]}),
        "client embeddings are off",
    )
    ok = post(
        trusting,
        {"messages": [{"role": "user", "content": [_embeds_part(4, width, grid), {"type": "text", "text": "?"}]}]},
    )
    assert ok.status_code == 200, ok.text
    assert answer(strict, image_messages(VICTIM[:1]))[0]
    assert httpx.get(stack["vllm"].url + "/health").status_code == 200


def _encoded(stack) -> tuple[dict, EmbeddingHandle]:
    eric = stack["erics"][1]
    item = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=60,
        json={"items": [{"modality": "image", "url": ATTACKER}]},
    ).json()["items"][0]
    return item, msgspec.convert(item["handle"], EmbeddingHandle)


def test_connector_fails_only_the_request_with_a_bad_handle(stack) -> None:
    """Behind the gateway (vLLM is internal), the connector still checks every handle: one that points at a host
    that is not a configured Eric, or whose rows, width or byte length do not fit, fails that request alone."""
    vllm = stack["vllm"]
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key=vllm.api_key, max_retries=0)
    model = client.models.list().data[0].id
    item, good = _encoded(stack)
    rows, width = good.shape
    bad = [
        msgspec.structs.replace(
            good, producer="http://10.0.0.1:1", http=f"http://10.0.0.1:1/v1/embeddings/{good.hash}"
        ),
        msgspec.structs.replace(good, shape=(rows - 1, width), nbytes=(rows - 1) * width * 4),
        msgspec.structs.replace(good, shape=(rows, width + 1), nbytes=rows * (width + 1) * 4),
        msgspec.structs.replace(good, nbytes=good.nbytes * 2),
    ]
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": item["grid_thw"]}, "uuid": item["hash"]}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]
    for handle in bad:
        try:
            resp = client.chat.completions.create(
                model=model, messages=messages, max_tokens=4, extra_body={"vllm_xargs": handles_xargs([handle])}
            )
            assert resp.choices[0].finish_reason == "error", handle
        except openai.APIStatusError as e:  # an error status for that request is as good
            assert e.status_code < 600
    assert httpx.get(vllm.url + "/health").status_code == 200
    # a failed request gave its lease back (the bad handles carried the same token): a fresh encode for the last
    item, good = _encoded(stack)
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, extra_body={"vllm_xargs": handles_xargs([good])}
    )
    assert resp.choices[0].finish_reason == "length"  # the good handle still serves


def _stream(total: int) -> Iterator[bytes]:
    chunk = b"x" * (1 << 20)
    for _ in range(total // len(chunk)):
        yield chunk


def _declared_only(base_url: str, path: str, length: int) -> tuple[int, bytes]:
    """POST that declares `length` bytes but sends 2: only a server that refuses on the header answers."""
    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n{{}}".encode()
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_big_bodies_refused_before_they_are_read(stack) -> None:
    """413 in the JSON error shape for bodies over a route's limit, declared (Content-Length) or streamed."""
    eric = stack["erics"][1]
    h = "0" * 64
    for url in (f"{eric.url}/v1/embeddings/{h}/ack", f"{eric.url}/v1/embeddings/{h}/lease", f"{eric.url}/v1/encode"):
        resp = httpx.post(url, content=_stream(48 << 20), headers=eric.headers, timeout=60)
        assert resp.status_code == 413 and "exceeds the limit" in resp.json()["error"]["message"], url
    gw = stack["strict"].url
    status, body = _declared_only(gw, "/v1/chat/completions", 1 << 30)
    assert status == 413 and b"exceeds the limit" in body
    resp = httpx.post(gw + "/v1/chat/completions", content=_stream(80 << 20), timeout=60)
    assert resp.status_code == 413 and "exceeds the limit" in resp.json()["error"]["message"]
    assert httpx.get(eric.url + "/health").status_code == 200
    assert answer(gw, image_messages(VICTIM[:1]))[0]


def test_vllm_behind_the_gateway_needs_its_own_key(stack) -> None:
    vllm = stack["vllm"]
    assert httpx.get(vllm.url + "/v1/models").status_code == 401
    assert httpx.get(vllm.url + "/v1/models", headers={"Authorization": "Bearer unused"}).status_code == 401
    assert httpx.get(vllm.url + "/v1/models", headers=vllm.headers).status_code == 200
    assert answer(stack["strict"].url, [{"role": "user", "content": "hi"}], key="any client key")[0]


NIXL_LISTENERS = """
import json, time
import numpy as np, psutil
from eric_epd.transfer.backends.nixl import NixlProducer
pool = np.zeros(1 << 20, np.uint8)
producer = NixlProducer("eric-listen-test", "http://127.0.0.1:1/v1/transfer/nixl/metadata", "127.0.0.1")
producer.register(pool.ctypes.data, pool.nbytes)
producer.metadata()
time.sleep(0.5)
print(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})))
producer.close()
"""


def test_nixl_producer_listens_only_on_its_advertised_interface() -> None:
    """UCX listens on every interface by default; Eric's NIXL agent only on the one carrying --advertise-host."""
    out = subprocess.run(
        [sys.executable, "-c", NIXL_LISTENERS],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    addresses = json.loads(out.stdout.strip().splitlines()[-1])
    assert addresses == ["127.0.0.1"], addresses
