"""Real SGLang servers on this CPU (eric_epd/testing/sglang_cpu.py), tiny Qwen2-VL in float32: `--language-only
--encoder-urls <Eric>` answers multi-image and video chats with the greedy tokens and logprobs of the same SGLang
serving the checkpoint alone, over every encoder transfer SGLang offers (zmq_to_scheduler, zmq_to_tokenizer, mooncake,
and nixl through Eric's plugin). The language-only servers load a copy of the checkpoint whose vision weights are
noise: had their own encoder run, their answers would be another model's (a test shows SGLang falls back to it when
its Eric is down). Every comparison has its negative control (another image set's answer fails it), and Eric's
counters show its rows were the ones used. The gateway's `--backend sglang` sends multi-image requests to the
language-only server and the rest to SGLang alone (streamed or not), and falls back to SGLang alone when the
language-only server is gone. Qwen3-VL: test_sglang_server_qwen3.py (its own servers, started after these stop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eric_epd.stack.process import running
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.ports import refusing_url
from eric_epd.testing.sglang_cpu import SglangServe
from eric_epd.testing.stack import ask, ask_greedy, gateway_paths, image_messages
from tests.support.sglang_served import (
    IMAGES,
    SGLANG_FLAGS,
    TEXT,
    TRANSFERS,
    VIDEOS,
    Family,
    family_servers,
    images,
    items_used,
    video,
)


@pytest.fixture(scope="module")
def families(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("sglang-server")
    eric, alone, language_only = family_servers(qwen2_vl_tiny, logs, "qwen2_vl", TRANSFERS)
    with refusing_url() as dead:
        eric_down = SglangServe(
            logs / "qwen2_vl-noise-vision", logs / "lo-eric-down.log", (dead,), "zmq_to_scheduler", SGLANG_FLAGS
        )
        with running(eric, alone, *language_only.values(), eric_down):
            family = Family(eric, alone, language_only)
            gateways = {
                name: GatewayServer(
                    logs / f"gateway-{name}.log",
                    *("--backend", "sglang", "--colocated-urls", alone.url),
                    *("--epd-prefill-urls", lo.url),
                )
                for name, lo in (("epd", language_only["zmq_to_scheduler"]), ("eric_down", eric_down))
            }
            with running(*gateways.values()):
                family.gateways, family.eric_down = gateways, eric_down
                yield {"qwen2_vl": family}


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_qwen2_vl_images_token_for_token(families: dict[str, Family], transfer: str) -> None:
    """Two images through Eric over `transfer`: SGLang alone's greedy tokens and logprobs; another pair's answer
    fails the same comparison."""
    family = families["qwen2_vl"]
    ours = family.through_eric(transfer, images(IMAGES[0], IMAGES[1]), "image", 2)
    assert_greedy_agree(ours, family.reference("01", images(IMAGES[0], IMAGES[1])), NEAR_TIE_FLOAT32, transfer)
    wrong = family.reference("02", images(IMAGES[0], IMAGES[2]))
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, f"{transfer}, another image")


@pytest.mark.parametrize("transfer", ["zmq_to_scheduler", "mooncake"])
def test_qwen2_vl_video_token_for_token(families: dict[str, Family], transfer: str) -> None:
    """A video through Eric, prepared as SGLang's own encoder prepares it (its frame count, its first resize): SGLang
    alone's answer; another video's fails the comparison."""
    family = families["qwen2_vl"]
    ours = family.through_eric(transfer, video(VIDEOS[0]), "video", 1)
    assert_greedy_agree(ours, family.reference("v0", video(VIDEOS[0])), NEAR_TIE_FLOAT32, transfer)
    assert_greedy_differ(ours, family.reference("v1", video(VIDEOS[1])), NEAR_TIE_FLOAT32, f"{transfer}, video")


def _paths_after(gateway: GatewayServer, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in gateway_paths(gateway).items() if v != before.get(k, 0)}


def _text(url: str, urls: list[str], stream: bool) -> str:
    """The answer's text to a chat with these images, whole or gathered from the stream."""
    answer = ask(url, image_messages(urls, TEXT), max_tokens=8, stream=stream)
    if not stream:
        return answer.choices[0].message.content or ""
    return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)


def _check_answer(url: str, alone: str, urls: list[str], wrong: list[str], stream: bool, label: str) -> None:
    """`url`'s answer is SGLang alone's, and another image set's answer is not: whole, greedy tokens and logprobs;
    streamed, the text against SGLang alone's whole answer's (SGLang streams logprobs only for tokens that complete
    text, and its chunks fall as timing does)."""
    if not stream:
        ours = ask_greedy(url, image_messages(urls, TEXT), max_tokens=8)
        assert_greedy_agree(ours, ask_greedy(alone, image_messages(urls, TEXT), max_tokens=8), NEAR_TIE_FLOAT32, label)
        other = ask_greedy(alone, image_messages(wrong, TEXT), max_tokens=8)
        assert_greedy_differ(ours, other, NEAR_TIE_FLOAT32, f"{label}, another image")
        return
    text = _text(url, urls, stream=True)
    assert text == _text(alone, urls, stream=False), label
    assert text != _text(alone, wrong, stream=False), f"{label}: the negative control passed"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gateway_sends_multi_image_requests_through_eric(families: dict[str, Family], stream: bool) -> None:
    """Two images through the gateway (the openai client, streamed or not): the EPD path, Eric's two images, and
    SGLang alone's answer; one image takes the plain path to SGLang alone."""
    family, urls = families["qwen2_vl"], [IMAGES[0], IMAGES[1]]
    gateway, alone = family.gateways["epd"], family.alone.url
    before, used = gateway_paths(gateway), items_used(family.eric, "image")
    _check_answer(gateway.url, alone, urls, [IMAGES[0], IMAGES[2]], stream, "gateway EPD")
    assert _paths_after(gateway, before) == {"epd": 1}
    assert items_used(family.eric, "image") - used == 2
    before = gateway_paths(gateway)
    _check_answer(gateway.url, alone, urls[:1], [IMAGES[2]], stream, "gateway plain")
    assert _paths_after(gateway, before) == {"pd": 1} and items_used(family.eric, "image") - used == 2


def test_a_language_only_server_without_its_eric_runs_its_own_encoder(families: dict[str, Family]) -> None:
    """SGLang's own fallback: a language-only server none of whose encoders is healthy encodes the media itself
    ("processing without encoder disaggregation"). This one's tower has noise weights, so its answer is not SGLang
    alone's: what the token tests would see had the servers behind Eric fallen back."""
    family = families["qwen2_vl"]
    assert family.eric_down is not None
    answer = ask_greedy(family.eric_down.url, image_messages([IMAGES[0], IMAGES[1]], TEXT), max_tokens=8)
    assert_greedy_differ(answer, family.reference("01", images(IMAGES[0], IMAGES[1])), NEAR_TIE_FLOAT32, "own tower")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gateway_falls_back_when_the_language_only_server_fails(families: dict[str, Family], stream: bool) -> None:
    """The language-only server is gone (killed): the gateway answers the request through SGLang alone (its
    fallback path), with SGLang alone's answer."""
    family, urls = families["qwen2_vl"], [IMAGES[0], IMAGES[1]]
    assert family.eric_down is not None
    family.eric_down.kill()
    gateway = family.gateways["eric_down"]
    before = gateway_paths(gateway)
    _check_answer(gateway.url, family.alone.url, urls, [IMAGES[0], IMAGES[2]], stream, "gateway fallback")
    assert _paths_after(gateway, before) == {"fallback": 1}
