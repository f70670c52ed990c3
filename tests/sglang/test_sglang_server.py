"""Real SGLang servers on this CPU (eric_epd/testing/sglang_cpu.py): `--language-only --encoder-urls <Eric>` answers
multi-image and video chats with the greedy tokens and logprobs of the same SGLang serving the checkpoint alone,
over every encoder transfer SGLang offers (zmq_to_scheduler, zmq_to_tokenizer, mooncake, and nixl through Eric's
plugin), for tiny Qwen2-VL and Qwen3-VL in float32. The language-only servers load a copy of the checkpoint whose
vision weights are noise: had their own encoder run, their answers would be another model's. Every comparison has
its negative control (another image set's answer fails it), and Eric's counters show its rows were the ones used.
The gateway's `--backend sglang` sends multi-image requests to the language-only server and the rest to SGLang alone
(streamed or not), and falls back to SGLang alone when the language-only server cannot have its media encoded."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.stack.process import running
from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.exactness import (
    NEAR_TIE_FLOAT32,
    Greedy,
    assert_greedy_agree,
    assert_greedy_differ,
    greedy_of_openai,
)
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.ports import refusing_url
from eric_epd.testing.sglang_cpu import SglangServe
from eric_epd.testing.stack import ask_greedy, gateway_paths, image_messages

TRANSFERS = ("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake", "nixl")
TEXT = "Describe them."
IMAGES = [image_data_url(84 + 28 * i, 56, seed=40 + i) for i in range(3)]
VIDEOS = [video_data_url(8, 64, 48, 4, seed=3), video_data_url(8, 64, 48, 4, seed=4)]
MM_CONFIG = '{"video": {"min_pixels": 12544}}'
"""SGLang's --mm-process-config, given to Eric too: a smaller first resize than SGLang's default 128 x 28 x 28 pixels a
frame (the test videos are 64 x 48), and the proof that Eric follows the prefills' setting."""
ERIC_FLAGS = ("--dtype", "float32", "--sglang-dtype", "float32", "--sglang-allowed-peer", "127.0.0.1/32")
ERIC_FLAGS += ("--sglang-mm-process-config", MM_CONFIG)
"""The prefills run --dtype float32; the NIXL session ids they send come from 127.0.0.1 (Eric accepts those only from
an allowed peer: a UCX address could name any host)."""
SGLANG_FLAGS = ("--mm-process-config", MM_CONFIG)


def with_noise_vision(model: Path, out: Path) -> Path:
    """A copy of `model` whose vision tower weights (`visual.` tensors) are seeded noise of the same shapes."""
    shutil.copytree(model, out)
    gen = torch.Generator().manual_seed(7)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        visual = [n for n in tensors if ".visual." in f".{n}"]
        assert visual, f"no vision tensors in {path}"
        for name in visual:
            t = tensors[name]
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.5
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def chat(server: SglangServe, content: list[dict]) -> Greedy:
    """Eight greedy tokens of a one-turn chat, each step's two best logprobs (the openai client)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)
    answer = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    return greedy_of_openai(answer.choices[0])


def images(*urls: str, text: str = TEXT) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


def video(url: str, text: str = "What happens?") -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]


def items_used(eric: EricServer, modality: str) -> float:
    """Items of `modality` Eric answered, encoded or from its cache (eric_items_total)."""
    text = httpx.get(eric.url + "/metrics", headers=eric.headers, timeout=10).text
    prefix = f'eric_items_total{{modality="{modality}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


class Family:
    """One family's servers: Eric, SGLang alone, and SGLang language-only per transfer; answers kept per content."""

    def __init__(self, eric: EricServer, alone: SglangServe, language_only: dict[str, SglangServe]) -> None:
        self.eric, self.alone, self.language_only = eric, alone, language_only
        self._alone: dict[str, Greedy] = {}
        self.gateways: dict[str, GatewayServer] = {}
        """"epd": the gateway before SGLang alone and the zmq_to_scheduler language-only server; "eric_down": before
        SGLang alone and `eric_down`."""
        self.eric_down: SglangServe | None = None
        """A language-only server whose only encoder refuses connections (Qwen2-VL only)."""

    def reference(self, key: str, content: list[dict]) -> Greedy:
        """SGLang alone's answer to `content` (asked once)."""
        if key not in self._alone:
            self._alone[key] = chat(self.alone, content)
        return self._alone[key]

    def through_eric(self, transfer: str, content: list[dict], modality: str, count: int) -> Greedy:
        """The language-only server's answer over `transfer`; Eric answers `count` items of `modality` for it."""
        before = items_used(self.eric, modality)
        got = chat(self.language_only[transfer], content)
        assert items_used(self.eric, modality) - before == count, f"Eric did not answer the {count} {modality} items"
        return got


@pytest.fixture(scope="module")
def families(qwen2_vl_tiny: Path, qwen3_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("sglang-server")
    erics = {
        f: EricServer(m, extra_args=ERIC_FLAGS, log_path=logs / f"eric-{f}.log")
        for f, m in (("qwen2_vl", qwen2_vl_tiny), ("qwen3_vl", qwen3_vl_tiny))
    }
    noise = {
        f: with_noise_vision(m, logs / f"{f}-noise-vision")
        for f, m in (("qwen2_vl", qwen2_vl_tiny), ("qwen3_vl", qwen3_vl_tiny))
    }
    alone = {
        f: SglangServe(m, logs / f"alone-{f}.log", extra_args=SGLANG_FLAGS)
        for f, m in (("qwen2_vl", qwen2_vl_tiny), ("qwen3_vl", qwen3_vl_tiny))
    }
    transfers = {"qwen2_vl": TRANSFERS, "qwen3_vl": ("zmq_to_scheduler",)}
    language_only = {
        f: {t: SglangServe(noise[f], logs / f"lo-{f}-{t}.log", (erics[f].url,), t, SGLANG_FLAGS) for t in transfers[f]}
        for f in erics
    }
    with refusing_url() as dead:
        eric_down = SglangServe(noise["qwen2_vl"], logs / "lo-eric-down.log", (dead,))
        servers = [*erics.values(), *alone.values(), *(s for per in language_only.values() for s in per.values())]
        with running(*servers, eric_down):
            out = {f: Family(erics[f], alone[f], language_only[f]) for f in erics}
            gateways = {
                name: GatewayServer(
                    logs / f"gateway-{name}.log",
                    *("--backend", "sglang", "--colocated-urls", alone["qwen2_vl"].url),
                    *("--epd-prefill-urls", lo.url),
                )
                for name, lo in (("epd", language_only["qwen2_vl"]["zmq_to_scheduler"]), ("eric_down", eric_down))
            }
            with running(*gateways.values()):
                out["qwen2_vl"].gateways, out["qwen2_vl"].eric_down = gateways, eric_down
                yield out


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


def test_qwen3_vl_images_and_video_token_for_token(families: dict[str, Family]) -> None:
    """Qwen3-VL (DeepStack rows; a video's timestamps in the prompt): images and a video through Eric give SGLang
    alone's answers; other media's answers fail the comparisons."""
    family = families["qwen3_vl"]
    ours = family.through_eric("zmq_to_scheduler", images(IMAGES[0], IMAGES[1]), "image", 2)
    assert_greedy_agree(ours, family.reference("01", images(IMAGES[0], IMAGES[1])), NEAR_TIE_FLOAT32, "images")
    assert_greedy_differ(ours, family.reference("02", images(IMAGES[0], IMAGES[2])), NEAR_TIE_FLOAT32, "images")
    ours = family.through_eric("zmq_to_scheduler", video(VIDEOS[0]), "video", 1)
    assert_greedy_agree(ours, family.reference("v0", video(VIDEOS[0])), NEAR_TIE_FLOAT32, "video")
    assert_greedy_differ(ours, family.reference("v1", video(VIDEOS[1])), NEAR_TIE_FLOAT32, "video")


def _paths_after(gateway: GatewayServer, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in gateway_paths(gateway).items() if v != before.get(k, 0)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_gateway_sends_multi_image_requests_through_eric(families: dict[str, Family], stream: bool) -> None:
    """Two images through the gateway (the openai client, streamed or not): the EPD path, Eric's two images, and
    SGLang alone's greedy answer asked the same way (SGLang streams no logprobs for a token that completes no text);
    one image takes the plain path to SGLang alone."""
    family, urls = families["qwen2_vl"], [IMAGES[0], IMAGES[1]]
    gateway, alone = family.gateways["epd"], family.alone.url
    before, used = gateway_paths(gateway), items_used(family.eric, "image")
    ours = ask_greedy(gateway.url, image_messages(urls, TEXT), max_tokens=8, stream=stream)
    assert _paths_after(gateway, before) == {"epd": 1}
    assert items_used(family.eric, "image") - used == 2
    reference = ask_greedy(alone, image_messages(urls, TEXT), max_tokens=8, stream=stream)
    assert_greedy_agree(ours, reference, NEAR_TIE_FLOAT32, "gateway EPD")
    wrong = ask_greedy(alone, image_messages([IMAGES[0], IMAGES[2]], TEXT), max_tokens=8, stream=stream)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "gateway EPD, another image")
    before = gateway_paths(gateway)
    one = ask_greedy(gateway.url, image_messages(urls[:1], TEXT), max_tokens=8, stream=stream)
    assert _paths_after(gateway, before) == {"pd": 1} and items_used(family.eric, "image") - used == 2
    reference = ask_greedy(alone, image_messages(urls[:1], TEXT), max_tokens=8, stream=stream)
    assert_greedy_agree(one, reference, NEAR_TIE_FLOAT32, "gateway plain")


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
    fallback path), with SGLang alone's greedy answer."""
    family, urls = families["qwen2_vl"], [IMAGES[0], IMAGES[1]]
    assert family.eric_down is not None
    family.eric_down.kill()
    gateway = family.gateways["eric_down"]
    before = gateway_paths(gateway)
    ours = ask_greedy(gateway.url, image_messages(urls, TEXT), max_tokens=8, stream=stream)
    assert _paths_after(gateway, before) == {"fallback": 1}
    reference = ask_greedy(family.alone.url, image_messages(urls, TEXT), max_tokens=8, stream=stream)
    assert_greedy_agree(ours, reference, NEAR_TIE_FLOAT32, "gateway fallback")
    wrong = ask_greedy(family.alone.url, image_messages([IMAGES[0], IMAGES[2]], TEXT), max_tokens=8, stream=stream)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "gateway fallback, another image")
