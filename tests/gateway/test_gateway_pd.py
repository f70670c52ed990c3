"""The plain PD path: the gateway joins a prefill and a decode vLLM (NixlConnector, CPU buffers); decode's answer
equals monolithic vLLM's. Multi-image requests go through Eric first and then the same prefill/decode pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import EricServer, GatewayServer, host_split, pd_vllm
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import ask_greedy, gateway_paths, image_messages


@pytest.fixture(scope="module")
def pd_stack(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pd")
    eric = EricServer(qwen2_vl_tiny, log_path=logs / "eric.log")
    vllm_key = new_key()  # one key for both halves, which the gateway sends
    # both engines on the core Eric does not use: a vLLM busy-polls after every step, and an Eric sharing its core
    # starves (a decode timed out here waiting on it; benchmarks/soak.py measured 0.13 against 8.7 req/s)
    core = host_split()[1][0]
    prefill = pd_vllm(qwen2_vl_tiny, "kv_producer", core, logs / "prefill.log", [eric.url], eric.api_key, vllm_key)
    decode = pd_vllm(qwen2_vl_tiny, "kv_consumer", core, logs / "decode.log", [eric.url], eric.api_key, vllm_key)
    gateway = GatewayServer(
        logs / "gateway.log",
        "--encoder-urls",
        eric.url,
        "--prefill-urls",
        prefill.url,
        "--decode-urls",
        decode.url,
        eric_api_key=eric.api_key,
        upstream_api_key=vllm_key,
    )
    with running(eric, prefill, decode), gateway:
        yield {"eric": eric, "prefill": prefill, "decode": decode, "gateway": gateway}


@pytest.fixture(scope="module")
def monolithic(pd_stack):
    """The reference: the prefill instance asked directly, without kv_transfer_params, runs the whole request
    itself (its own vision encoder on the raw images, its own decode), as a monolithic vLLM does."""
    return pd_stack["prefill"]


TEXT = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog, please."}]
ONE = image_messages([image_data_url(120, 90, seed=41)])
THREE = image_messages([image_data_url(64 + 20 * i, 80, seed=50 + i) for i in range(3)])
# the negative controls' wrong input: images of the same sizes, other pixels
OTHER_ONE = image_messages([image_data_url(120, 90, seed=42)])
OTHER_THREE = image_messages([image_data_url(64 + 20 * i, 80, seed=70 + i) for i in range(3)])


def test_pd_over_nixl_equals_monolithic(pd_stack, monolithic) -> None:
    gw = pd_stack["gateway"]
    before = gateway_paths(gw)
    # up to the first near tie: Eric's tower against vLLM's for THREE; for all, the prefill's prefix cache computes
    # a repeated prompt's tail alone, in other shapes than the whole prompt
    for label, msgs in (("text", TEXT), ("one image", ONE), ("three images", THREE)):
        ours = ask_greedy(gw.url, msgs)
        assert_greedy_agree(ours, ask_greedy(monolithic.url, msgs, key=monolithic.api_key), NEAR_TIE_FLOAT32, label)
    after = gateway_paths(gw)
    assert after.get("pd", 0) - before.get("pd", 0) == 2  # text and one image: prefill -> decode
    assert after.get("epd", 0) - before.get("epd", 0) == 1  # three images: Eric -> prefill -> decode
    wrong = ask_greedy(monolithic.url, OTHER_THREE, key=monolithic.api_key)  # `ours` is the three images' answer
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "three images, against other images' answer")


def test_pd_streaming_equals_monolithic(pd_stack, monolithic) -> None:
    streamed = ask_greedy(pd_stack["gateway"].url, ONE, stream=True)
    assert len(streamed.tokens) == 10
    assert_greedy_agree(
        streamed, ask_greedy(monolithic.url, ONE, key=monolithic.api_key), NEAR_TIE_FLOAT32, "one image, streamed"
    )
    wrong = ask_greedy(monolithic.url, OTHER_ONE, key=monolithic.api_key)
    assert_greedy_differ(streamed, wrong, NEAR_TIE_FLOAT32, "one image, streamed, against another image's answer")


def test_dead_prefill_or_decode_gives_a_clear_error_not_a_hang(pd_stack, tmp_path: Path) -> None:
    import httpx

    from eric_epd.testing.ports import refusing_url

    live = {"prefill": pd_stack["prefill"].url, "decode": pd_stack["decode"].url}
    key = pd_stack["decode"].api_key
    model = httpx.get(live["decode"] + "/v1/models", headers=pd_stack["decode"].headers).json()["data"][0]["id"]
    for role, status in (("prefill", 502), ("decode", 503)):
        with refusing_url() as dead:
            urls = {**live, role: dead}
            with GatewayServer(
                tmp_path / f"gw-{role}.log",
                "--prefill-urls",
                urls["prefill"],
                "--decode-urls",
                urls["decode"],
                upstream_api_key=key,
            ) as gw:
                r = httpx.post(
                    gw.url + "/v1/chat/completions",
                    json={"model": model, "messages": TEXT, "max_tokens": 4},
                    timeout=60,
                )
                assert r.status_code == status, r.text
                message = r.json()["error"]["message"]
                assert message.startswith(f"{role} at <internal>") and dead not in message  # named by role only
