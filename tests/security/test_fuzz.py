"""Property-based fuzzing of Eric's and the gateway's HTTP surfaces from their own OpenAPI descriptions
(schemathesis: schema-valid and schema-violating requests, derandomized, a bounded number per operation): no 5xx,
every answer inside the documented schema, and every server healthy and answering right afterwards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import ask_greedy, image_messages

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 20
"""Examples per operation and generation mode (a bounded time in CI)."""
GATEWAY_KEY = "sk-fuzz"


def _schema(url: str, headers: dict[str, str]) -> schemathesis.BaseSchema:
    resp = httpx.get(url + "/openapi.json", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return schemathesis.openapi.from_dict(resp.json())


def _fuzz(schema: schemathesis.BaseSchema, mode: GenerationMode, call: Callable[[Any], Any]) -> dict[str, Counter]:
    """Run `call` on EXAMPLES derandomized cases of every operation; the statuses each operation answered."""
    seen = {}
    for operation in (result.ok() for result in schema.get_all_operations()):
        try:
            seen[operation.label] = _fuzz_operation(operation, mode, call)
        except Unsatisfiable:  # negative mode: nothing in this operation's parameters can be made invalid
            seen[operation.label] = Counter()
        except Exception as e:
            raise AssertionError(f"{operation.label} ({mode.value}): {e}") from e
    return seen


def _fuzz_operation(operation: Any, mode: GenerationMode, call: Callable[[Any], Any]) -> Counter:
    statuses: Counter = Counter()

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        statuses[call(case).status_code] += 1

    run()
    return statuses


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """SGLang's early calls for a req_id no /encode posted wait 2 s (not 180) before their 404."""
    with EricServer(
        qwen2_vl_tiny, log_path=tmp_path_factory.mktemp("fuzz") / "eric.log", extra_args=("--sglang-req-timeout", "2")
    ) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(vllm_behind_erics, tmp_path_factory: pytest.TempPathFactory):
    erics, vllm = vllm_behind_erics["erics"], vllm_behind_erics["vllm"]
    with GatewayServer(
        tmp_path_factory.mktemp("fuzz-gw") / "gateway.log",
        "--encoder-urls",
        ",".join(e.url for e in erics),
        "--colocated-urls",
        vllm.url,
        "--api-key",
        GATEWAY_KEY,
        "--admin-key",
        "admin-fuzz",
        eric_api_key=vllm_behind_erics["eric_key"],
        upstream_api_key=vllm.api_key,
    ) as server:
        yield server


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_eric_surface(eric, mode: GenerationMode) -> None:
    def call(case) -> Any:
        return case.call_and_validate(base_url=eric.url, headers=eric.headers, checks=CHECKS, timeout=60)

    seen = _fuzz(_schema(eric.url, eric.headers), mode, call)
    assert len(seen) >= 15 and sum(seen["POST /v1/encode"].values()) > 0, seen
    if mode is GenerationMode.NEGATIVE:
        assert set(seen["POST /v1/encode"]) <= {400, 413}, seen["POST /v1/encode"]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_gateway_surface(gateway, mode: GenerationMode) -> None:
    def call(case) -> Any:
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 4)  # a short answer: the surface is under test
        return case.call_and_validate(
            base_url=gateway.url, headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, checks=CHECKS, timeout=120
        )

    seen = _fuzz(_schema(gateway.url, {}), mode, call)
    chat = seen["POST /v1/chat/completions"]
    assert len(seen) >= 7 and sum(chat.values()) > 0, seen
    if mode is GenerationMode.POSITIVE:
        assert chat[200] > 0, chat  # schema-valid chats reached the engine and were answered


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_hostile_bodies_get_a_named_4xx(eric, gateway) -> None:
    """The hostile requests seen answering 500 or echoed back: each gets a 4xx naming the problem, in the route's
    error shape, without echoing the client's megabyte."""
    from eric_epd.testing.media import image_data_url as png

    big = "x" * (1 << 20)
    json_headers = {"content-type": "application/json"}
    cases = [
        (eric.url + "/v1/encode", b'{"items": ' + _deep(100_000) + b"}", "nested deeper than 32"),
        (eric.url + "/v1/encode", b'{"items": ' + _deep(20) + b"}", "item 0 must be an object"),
        (eric.url + "/v1/encode", b"\xff\xfe{", "malformed JSON"),
        (
            eric.url + "/v1/encode",
            orjson.dumps({"items": [{"id": big, "modality": "image", "url": png(8, 8)}]}),
            "over the limit of 256",
        ),
        (
            eric.url + "/v1/encode",
            orjson.dumps({"items": [{"modality": big, "url": png(8, 8)}]}),
            "unsupported modality",
        ),
        (
            eric.url + "/v1/encode",
            orjson.dumps({"items": [{"modality": "image", "url": "http://a/" + "b" * 9000}]}),
            "over the limit of 8192",
        ),
        (
            eric.url + "/v1/encode",
            orjson.dumps({"items": [{"modality": "image", "url": png(1000, 4)}]}),
            "aspect ratio",
        ),
        (eric.url + "/v1/embeddings/abc/ack", _deep(1000), "nested deeper than 32"),
        (
            eric.url + "/encode",
            b'{"req_id": "r", "num_parts": 1, "part_idx": 0, "mm_items": [{"a": ' + _deep(100_000) + b"}]}",
            "nested too deeply",
        ),
        (
            eric.url + "/encode",
            orjson.dumps({"req_id": big, "num_parts": 1, "part_idx": 0, "mm_items": ["x"]}),
            "req_id",
        ),
        (
            eric.url + "/send",
            b'{"req_id": "r", "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": 1, '
            b'"session_id": "s", "buffer_address": ' + str(2**70).encode() + b"}",
            "buffer_address",
        ),
        (
            gateway.url + "/v1/chat/completions",
            b'{"model": "m", "messages": ' + _deep(100_000) + b"}",
            "nested deeper than 32",
        ),
        (gateway.url + "/v1/chat/completions", orjson.dumps({"model": big, "messages": []}), "'model' must be"),
    ]
    headers = {
        "eric": eric.headers | json_headers,
        "gateway": {"Authorization": f"Bearer {GATEWAY_KEY}"} | json_headers,
    }
    for url, body, named in cases:
        resp = httpx.post(
            url, content=body, headers=headers["gateway" if url.startswith(gateway.url) else "eric"], timeout=60
        )
        assert 400 <= resp.status_code < 500 and named in resp.text, (url, body[:80], resp.status_code, resp.text)
        assert len(resp.content) < 2048, (url, len(resp.content))
        sglang_route = url.endswith(("/encode", "/send")) and "/v1/" not in url
        assert resp.json().get("status") == "error" if sglang_route else "message" in resp.json()["error"], resp.text
    for url, headers_ in ((eric.url, eric.headers), (gateway.url, {})):
        assert httpx.get(url + "/health", headers=headers_, timeout=30).status_code == 200


def test_servers_healthy_and_right_after_fuzzing(eric, gateway, vllm_behind_erics) -> None:
    for url, headers in ((eric.url, eric.headers), (gateway.url, {}), (vllm_behind_erics["vllm"].url, {})):
        assert httpx.get(url + "/health", headers=headers, timeout=30).status_code == 200, url
    vllm = vllm_behind_erics["vllm"]
    msgs = image_messages([image_data_url(64, 64, seed=700 + i) for i in range(2)])
    ours = ask_greedy(gateway.url, msgs, key=GATEWAY_KEY)
    # EPD: Eric's tower against vLLM's, exact up to the first near tie
    assert_greedy_agree(ours, ask_greedy(vllm.url, msgs, key=vllm.api_key), NEAR_TIE_FLOAT32, "EPD after fuzzing")
    others = image_messages([image_data_url(64, 64, seed=750 + i) for i in range(2)])  # the same sizes, other pixels
    wrong = ask_greedy(vllm.url, others, key=vllm.api_key)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "EPD after fuzzing, against other images' answer")
