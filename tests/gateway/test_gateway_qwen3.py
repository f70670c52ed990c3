"""Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 through the gateway and real `vllm serve` behind Eric, with the openai client
(Qwen3.5-MoE: not here, eric_epd/checkpoints/support.py says why): several images go EPD (DeepStack levels and all)
and answer what vLLM answers on its own (token for token up to the first near tie: two towers' float sums), and not
what it answers for other images; one image takes the plain path (exactly vLLM's answer); a request with a video goes
EPD too (Eric samples the frames vLLM would and states their timestamps) and answers the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eric_epd.checkpoints.support import vllm_proven
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_BFLOAT16, NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.lookahead import Cpus, Launched, Lookahead, lookahead_fixture
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.stack import ask_greedy, colocated_epd, gateway_paths, image_messages


@pytest.fixture(scope="module")
def stacks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_cache: Path
) -> Iterator[Lookahead]:
    """Each family's Eric, vLLM and gateway, the next family's launched while this one's tests run. Qwen3.5 in
    bfloat16: vLLM's only CPU path for its linear attention."""
    from eric_epd.checkpoints.builtin import ensure_checkpoint

    def build(family: str, eric_cpus: Cpus, engine_cpus: Cpus) -> Launched:
        dtype = "bfloat16" if family.startswith("qwen3_5") else "float32"
        launched = colocated_epd(
            ensure_checkpoint(family, "tiny"),
            tmp_path_factory.mktemp(f"{family}-gateway"),
            dtype,
            eric_cpus,
            engine_cpus,
        )
        launched.value["near_tie"] = NEAR_TIE_BFLOAT16 if dtype == "bfloat16" else NEAR_TIE_FLOAT32
        return launched

    yield from lookahead_fixture(request, "stack", build)


@pytest.fixture(scope="module", params=vllm_proven("tests/gateway/test_gateway_qwen3.py"))
def stack(request: pytest.FixtureRequest, stacks: Lookahead) -> Iterator[dict]:
    """One family's stack."""
    yield stacks.take(request.param)
    stacks.release(request.param)


def _paths_delta(gw: GatewayServer, before: dict[str, float]) -> dict[str, float]:
    after = gateway_paths(gw)
    changed = {k for k in set(after) | set(before) if after.get(k, 0) != before.get(k, 0)}
    return {k: after.get(k, 0) - before.get(k, 0) for k in changed}


def test_several_images_go_epd_and_answer_like_vllm(stack) -> None:
    gw, vllm = stack["gateway"].url, stack["vllm"]
    msgs = image_messages([image_data_url(64 + 16 * i, 96 - 8 * i, seed=300 + i) for i in range(3)])
    direct = ask_greedy(vllm.url, msgs, key=vllm.api_key)
    before = gateway_paths(stack["gateway"])
    ours = ask_greedy(gw, msgs)
    assert_greedy_agree(ours, direct, stack["near_tie"], "three images, EPD")
    assert _paths_delta(stack["gateway"], before) == {"epd": 1}
    other = image_messages([image_data_url(64 + 16 * i, 96 - 8 * i, seed=350 + i) for i in range(3)])
    wrong = ask_greedy(vllm.url, other, key=vllm.api_key)  # the same sizes, other pixels
    assert_greedy_differ(ours, wrong, stack["near_tie"], "three images, EPD, against other images' answer")


def test_one_image_takes_the_plain_path(stack) -> None:
    gw, vllm = stack["gateway"].url, stack["vllm"]
    msgs = image_messages([image_data_url(120, 90, seed=310)])
    direct = ask_greedy(vllm.url, msgs, key=vllm.api_key)
    before = gateway_paths(stack["gateway"])
    ours = ask_greedy(gw, msgs)
    assert_greedy_agree(ours, direct, stack["near_tie"], "one image, plain path")  # vLLM's prefix cache: other shapes
    assert "epd" not in _paths_delta(stack["gateway"], before)
    wrong = ask_greedy(vllm.url, image_messages([image_data_url(120, 90, seed=360)]), key=vllm.api_key)
    assert_greedy_differ(ours, wrong, stack["near_tie"], "one image, plain path, against another image's answer")


def test_images_and_a_video_go_epd(stack) -> None:
    gw, vllm = stack["gateway"].url, stack["vllm"]
    msgs = image_messages([image_data_url(64, 64, seed=320), image_data_url(96, 64, seed=321)])
    msgs[0]["content"].insert(2, {"type": "video_url", "video_url": {"url": video_data_url(8, 64, 64, fps=4, seed=3)}})
    direct = ask_greedy(vllm.url, msgs, key=vllm.api_key)
    before = gateway_paths(stack["gateway"])
    ours = ask_greedy(gw, msgs)
    assert_greedy_agree(ours, direct, stack["near_tie"], "two images and a video, EPD")
    assert _paths_delta(stack["gateway"], before) == {"epd": 1}
    other = image_messages([image_data_url(64, 64, seed=370), image_data_url(96, 64, seed=371)])
    other[0]["content"].insert(2, {"type": "video_url", "video_url": {"url": video_data_url(8, 64, 64, fps=4, seed=7)}})
    wrong = ask_greedy(vllm.url, other, key=vllm.api_key)  # the same sizes and frame count, other pixels
    assert_greedy_differ(ours, wrong, stack["near_tie"], "two images and a video, EPD, against other media's answer")
