"""The generic-path families through the gateway and real `vllm serve` behind Eric, one family after another (those
eric_epd/checkpoints/support.py says this module proves): several images of different sizes go EPD as their media,
keyed by Eric's content hash, so vLLM's own processor lays out each placeholder and the connector fills it with
Eric's rows (vLLM's encoder stays idle); the answer is token for token the one the same vLLM gives with its own
encoder (up to the first near tie: two towers' float sums)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eric_epd.checkpoints.families import ensure_family_checkpoint
from eric_epd.checkpoints.support import FAMILY_SUPPORT, GENERIC_VLLM, vllm_proven
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.lookahead import Cpus, Launched, Lookahead, lookahead_fixture
from eric_epd.testing.media import data_url, image_bytes, random_image, video_data_url
from eric_epd.testing.stack import ask_token_ids, colocated_epd, image_messages, metric, wait_for

pytestmark = pytest.mark.exactness

SIZES = ((96, 64), (48, 80), (130, 100))
"""Wide, tall and larger than a tile: every family lays them out differently."""
MAX_TOKENS = 8


class _Counting(SimpleHTTPRequestHandler):
    gets: list[str]

    def do_GET(self) -> None:
        self.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


def _pngs(seed: int) -> list[bytes]:
    return [image_bytes(random_image(w, h, seed=seed + i)) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two sets of images of the same sizes (the same prompt tokens, other content); the first image of each set is
    also served over http (the gateway fetches it, counted here)."""
    root = tmp_path_factory.mktemp("media")
    sets = [_pngs(700), _pngs(800)]
    for n, pngs in enumerate(sets):
        (root / f"{n}.png").write_bytes(pngs[0])
    gets: list[str] = []
    handler = type("Handler", (_Counting,), {"gets": gets})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield {"sets": sets, "urls": [f"{base}/{n}.png" for n in range(len(sets))], "gets": gets}
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def stacks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_cache: Path
) -> Iterator[Lookahead]:
    """Each family's Eric, `vllm serve` behind it and the gateway, the next family's launched while this one's tests
    run (eric_epd/testing/lookahead.py)."""

    def build(family: str, eric_cpus: Cpus, engine_cpus: Cpus) -> Launched:
        model = ensure_family_checkpoint(family)
        launched = colocated_epd(
            model,
            tmp_path_factory.mktemp(f"{family}-epd"),
            eric_cpus=eric_cpus,
            engine_cpus=engine_cpus,
            media_hosts=("127.0.0.1",),
        )  # the image origin
        launched.value["family"] = family
        return launched

    yield from lookahead_fixture(request, "stack", build)


@pytest.fixture(scope="module", params=vllm_proven(GENERIC_VLLM))
def stack(request: pytest.FixtureRequest, stacks: Lookahead) -> Iterator[dict]:
    """One family's stack; stopped before the one after the next starts."""
    yield stacks.take(request.param)
    stacks.release(request.param)


def _counter(url: str, name: str) -> float:
    return metric(url, f"vllm:eric_ec_{name}_total")


def _reaches(url: str, name: str, value: float) -> bool:
    """Whether the connector's counter `name` comes to `value` (vLLM publishes its stats a moment later)."""
    return wait_for(lambda: _counter(url, name) == value)


def test_images_go_epd_as_media_and_answer_like_vllm(stack, media) -> None:
    """Each set first straight to vLLM (its own encoder), then through the gateway (Eric's rows). The second set's
    prompt has the first's tokens with other images: vLLM's prefix and encoder caches, keyed by content (Eric's
    hash, or vLLM's own), serve none of the first set's work to it. Negative control: the first set's EPD answer
    fails the same comparison with vLLM's answer for the second set (the same sizes, other pixels)."""
    gw, vllm, family = stack["gateway"].url, stack["vllm"], stack["family"]
    answers = []
    for pngs, url in zip(media["sets"], media["urls"], strict=True):
        inline = [data_url(png) for png in pngs]
        before = {k: _counter(vllm.url, k) for k in ("loaded_items", "local_encoder_items")}
        direct, _ = ask_token_ids(vllm.url, image_messages(inline), key=vllm.api_key, max_tokens=MAX_TOKENS)
        assert _reaches(vllm.url, "local_encoder_items", before["local_encoder_items"] + 3)

        fetched = len(media["gets"])
        epd, path = ask_token_ids(gw, image_messages([url, *inline[1:]]), max_tokens=MAX_TOKENS)
        assert path == "epd"
        assert len(media["gets"]) == fetched + 1  # fetched once by the gateway; Eric and vLLM got its data: URL
        assert _reaches(vllm.url, "loaded_items", before["loaded_items"] + 3)
        assert _counter(vllm.url, "local_encoder_items") == before["local_encoder_items"] + 3  # idle for EPD
        assert_greedy_agree(epd, direct, NEAR_TIE_FLOAT32, family)
        answers.append((epd, direct))
    assert_greedy_differ(answers[0][0], answers[1][1], NEAR_TIE_FLOAT32, f"{family} against other images' answer")


def test_a_video_goes_epd_where_eric_encodes_the_familys_videos(stack, media) -> None:
    """A family whose videos Eric encodes (its card says so): an image and a 40-frame video (content no other test
    sent, so neither cache holds it) go EPD, Eric sampling the 32 frames vLLM's loader takes, and the answer is
    vLLM's own, not its answer for another image and video of the same sizes and length (the negative control). The
    other families' cards offer images only, and their Eric refuses a video with a 400 naming the modality (the
    gateway sends their videos to the engine with the request)."""
    import httpx

    eric, vllm, family = stack["eric"], stack["vllm"], stack["family"]
    card = httpx.get(eric.url + "/v1/models", headers=eric.headers, timeout=10).json()["data"][0]
    [support] = [f for f in FAMILY_SUPPORT if f.model_type == family]
    assert card["modalities"] == list(support.modalities)
    video = video_data_url(40, 64, 48, fps=8, seed=41)
    if "video" not in support.modalities:
        refused = httpx.post(
            eric.url + "/v1/encode",
            json={"items": [{"modality": "video", "url": video}]},
            headers=eric.headers,
            timeout=30,
        )
        assert refused.status_code == 400, refused.text
        assert "unsupported modality 'video'" in refused.json()["error"]["message"], refused.text
        return
    messages, others = (
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image_bytes(random_image(80, 60, seed=i)))}},
                    {"type": "video_url", "video_url": {"url": video_data_url(40, 64, 48, fps=8, seed=v)}},
                    {"type": "text", "text": "What happens?"},
                ],
            }
        ]
        for i, v in ((901, 41), (902, 42))
    )
    before = {k: _counter(vllm.url, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, messages, key=vllm.api_key, max_tokens=MAX_TOKENS)
    wrong, _ = ask_token_ids(vllm.url, others, key=vllm.api_key, max_tokens=MAX_TOKENS)
    assert _reaches(vllm.url, "local_encoder_items", before["local_encoder_items"] + 4)
    epd, path = ask_token_ids(stack["gateway"].url, messages, max_tokens=MAX_TOKENS)
    assert path == "epd"
    assert _reaches(vllm.url, "loaded_items", before["loaded_items"] + 2)
    assert _counter(vllm.url, "local_encoder_items") == before["local_encoder_items"] + 4
    assert_greedy_agree(epd, direct, NEAR_TIE_FLOAT32, family)
    assert_greedy_differ(epd, wrong, NEAR_TIE_FLOAT32, f"{family} against another image's and video's answer")
