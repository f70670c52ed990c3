"""Qwen2.5-VL videos through the gateway and real vLLM behind Eric: a video sampled at Eric's 2 fps goes EPD; one
whose frames end up spaced otherwise (here a 1 fps source) would be misplaced in time by vLLM's metadata-only path,
so it goes with its raw media, and the leases its encode took are given back at once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from eric_epd.stack.servers import EricServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.stack import ask, ask_greedy, colocated_epd_stack, gateway_paths
from eric_epd.wire.handles import LEASE_HEADER


@pytest.fixture(scope="module")
def stack(qwen2_5_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    with colocated_epd_stack(qwen2_5_vl_tiny, tmp_path_factory.mktemp("qwen25-video")) as servers:
        yield servers


def _messages(video_url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(64, 56, seed=5)}},
                {"type": "video_url", "video_url": {"url": video_url}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]


def _encode_video(eric: EricServer, url: str) -> dict:
    items = httpx.post(
        eric.url + "/v1/encode", json={"items": [{"modality": "video", "url": url}]}, headers=eric.headers
    ).json()["items"]
    ack = httpx.post(
        f"{eric.url}/v1/embeddings/{items[0]['hash']}/ack",
        headers={**eric.headers, LEASE_HEADER: items[0]["handle"]["lease"]},
    )
    assert ack.status_code == 200, ack.text
    return items[0]


def test_videos_take_epd_only_when_vllm_can_place_them(stack) -> None:
    gw, eric = stack["gateway"].url, stack["eric"]
    at_2fps = video_data_url(8, 56, 56, fps=4, seed=1)  # 2 s: 4 of 8 frames, 1 s per temporal grid step
    at_1fps = video_data_url(4, 56, 56, fps=1, seed=2)  # 4 s at 1 fps: every frame, 2 s per grid step
    assert _encode_video(eric, at_2fps)["second_per_grid_ts"] == 1.0
    assert _encode_video(eric, at_1fps)["second_per_grid_ts"] == 2.0

    before = gateway_paths(stack["gateway"])
    assert ask(gw, _messages(at_2fps)).choices[0].message.content
    after = gateway_paths(stack["gateway"])
    assert after.get("epd", 0) - before.get("epd", 0) == 1

    vllm = stack["vllm"]
    direct = ask_greedy(vllm.url, _messages(at_1fps), key=vllm.api_key)  # vLLM encodes it itself
    ours = ask_greedy(gw, _messages(at_1fps))
    assert_greedy_agree(ours, direct, NEAR_TIE_FLOAT32, "1 fps video, fallback")  # prefix cache: other shapes
    other = video_data_url(4, 56, 56, fps=1, seed=3)  # the same frames, size and rate, other pixels
    wrong = ask_greedy(vllm.url, _messages(other), key=vllm.api_key)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "1 fps video, fallback, against another video's answer")
    assert gateway_paths(stack["gateway"]).get("fallback", 0) - after.get("fallback", 0) == 1
    deadline = time.monotonic() + 30
    while httpx.get(eric.url + "/v1/transfer", headers=eric.headers).json()["entries"] and time.monotonic() < deadline:
        time.sleep(0.1)  # the EPD request's items are acknowledged by vLLM, the fallback's by the gateway
    assert httpx.get(eric.url + "/v1/transfer", headers=eric.headers).json()["entries"] == 0
