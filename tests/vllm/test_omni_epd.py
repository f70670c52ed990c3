"""The Omni thinkers' EPD (Qwen2.5-Omni; Qwen3-Omni-MoE, whose image and video rows are DeepStack rows wider than its
audio rows) through real `vllm serve` behind a real Eric (tiny offline checkpoints): two audio clips,
a clip and an image, and a video (without its audio) go to vLLM keeping their data (its processor lays out each
placeholder), each part carrying Eric's content hash as its uuid and Eric's handles in `vllm_xargs`; the connector
fills every placeholder with Eric's rows (vLLM's encoder stays idle) and the answer is token for token the one the same
vLLM gives the same request with its own encoder (up to the first near tie). A video with its soundtrack
(`use_audio_in_video`, both families: a 2 s video, so a 2 s soundtrack) goes the same way: Eric encodes both, the
connector fills the video's and the soundtrack's interleaved placeholders (vLLM lays them out per family:
Qwen2.5-Omni's by chunks, Qwen3-Omni's by each token's time). Then the gateway in front sends a mixed audio + image
request, and a video with its soundtrack, down the EPD path, every item to Eric. Clips are at 16 kHz (vLLM here
cannot resample), each at least a second (a shorter Qwen3-Omni clip's rows depend on its batch, in vLLM too) and off
the 160-sample hop."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.lookahead import Cpus, Launched, Lookahead, lookahead_fixture
from eric_epd.testing.media import audio_bytes, data_url, image_bytes, random_image, video_bytes, video_with_audio_bytes
from eric_epd.testing.pools import held_bytes
from eric_epd.testing.stack import ask_token_ids, metric, wait_for
from eric_epd.wire.handoff import handles_xargs, soundtrack_uuid, soundtracks_xargs

pytestmark = pytest.mark.exactness

RATE = 16000
MAX_TOKENS = 8


def _clip(frames: int, seed: int) -> tuple[str, bytes]:
    return "audio", audio_bytes(frames, RATE, 1, "wav", seed=seed)


CASES = {
    "two_clips": (_clip(RATE + 333, 31), _clip(2 * RATE + 7, 32)),
    "clip_and_image": (_clip(3 * RATE // 2 + 1, 33), ("image", image_bytes(random_image(96, 64, seed=34)))),
    "video": (("video", video_bytes(num_frames=8, width=64, height=48, fps=4, seed=35)),),
}
"""Case -> (modality, bytes) per item: no item in two cases (neither of vLLM's caches holds a case's media)."""
OTHERS = {
    "two_clips": (_clip(RATE + 333, 131), _clip(2 * RATE + 7, 132)),
    "clip_and_image": (_clip(3 * RATE // 2 + 1, 133), ("image", image_bytes(random_image(96, 64, seed=134)))),
    "video": (("video", video_bytes(num_frames=8, width=64, height=48, fps=4, seed=135)),),
}
"""The negative controls' media: each case's items with other content of the same lengths and sizes."""
MIME = {"audio": "audio/wav", "image": "image/png", "video": "video/mp4"}


FAMILIES = ("qwen2_5_omni", "qwen3_omni_moe")
"""The Omni families (checkpoints/audio_families.py builds their tiny checkpoints)."""


@pytest.fixture(scope="module")
def stacks(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_cache: Path
) -> Iterator[Lookahead]:
    """Each family's Eric and `vllm serve` with the connector behind it, the next family's launched while this
    one's tests run."""
    from eric_epd.checkpoints.audio_families import ensure_audio_checkpoint

    def build(family: str, eric_cpus: Cpus, engine_cpus: Cpus) -> Launched:
        model, logs = ensure_audio_checkpoint(family), tmp_path_factory.mktemp(f"{family}-epd")
        eric = EricServer(model, log_path=logs / "eric.log", extra_args=("--dtype", "float32"), cpus=eric_cpus)
        vllm = VllmServe(model, logs / "vllm.log", eric_urls=[eric.url], eric_api_key=eric.api_key, cpus=engine_cpus)
        return Launched((eric, vllm), {"servers": (eric, vllm, family)})

    yield from lookahead_fixture(request, "stack", build)


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request: pytest.FixtureRequest, stacks: Lookahead) -> Iterator[tuple[EricServer, VllmServe, str]]:
    """One family's Eric and vLLM."""
    yield stacks.take(request.param)["servers"]
    stacks.release(request.param)


def _part(modality: str, data: bytes, uuid: str | None) -> dict:
    """An OpenAI content part for one item (with its uuid, if given)."""
    if modality == "audio":
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    else:
        key = f"{modality}_url"
        part = {"type": key, key: {"url": data_url(data, MIME[modality])}}
    return part | ({"uuid": uuid} if uuid else {})


def _messages(items: tuple[tuple[str, bytes], ...], uuids: list[str] | None = None) -> list[dict]:
    parts = [_part(m, d, uuids[n] if uuids else None) for n, (m, d) in enumerate(items)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


def _counter(vllm: VllmServe, name: str) -> float:
    return metric(vllm.url, f"vllm:eric_ec_{name}_total")


def _direct(vllm: VllmServe, items: tuple[tuple[str, bytes], ...]):
    """The request straight to vLLM (its own encoder runs once per item, the connector loads nothing)."""
    before = {k: _counter(vllm, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, _messages(items), key=vllm.api_key, max_tokens=MAX_TOKENS)
    local = before["local_encoder_items"] + len(items)
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") == local)
    assert _counter(vllm, "loaded_items") == before["loaded_items"]
    return direct, before["loaded_items"], local


def _gateway(eric: EricServer, vllm: VllmServe, tmp_path: Path, *flags: str) -> GatewayServer:
    """A gateway in front of the stack's Eric and vLLM (not started), with `flags`."""
    return GatewayServer(
        tmp_path / "gateway.log",
        *("--encoder-urls", eric.url, "--colocated-urls", vllm.url, *flags),
        eric_api_key=eric.api_key,
        upstream_api_key=vllm.api_key,
    )


@pytest.mark.parametrize("case", CASES)
def test_omni_items_go_epd_as_media_and_answer_like_vllm(stack: tuple[EricServer, VllmServe, str], case: str) -> None:
    """The items straight to vLLM, then encoded by Eric and sent with its hashes and handles: the connector loads
    every item's rows from Eric, vLLM's encoder runs no more, and the greedy answer is vLLM's own, not its answer
    for other items of the same lengths and sizes (the negative control)."""
    eric, vllm, family = stack
    items = CASES[case]
    direct, loaded, _ = _direct(vllm, items)
    wrong, _, local = _direct(vllm, OTHERS[case])
    resp = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=120,
        json={"items": [{"modality": m, "url": data_url(d, MIME[m])} for m, d in items]},
    )
    assert resp.status_code == 200, resp.text
    encoded = resp.json()["items"]
    assert [(i["modality"], i["placement"]) for i in encoded] == [(m, "media") for m, _ in items]
    epd, _ = ask_token_ids(
        vllm.url,
        _messages(items, [i["hash"] for i in encoded]),
        key=vllm.api_key,
        max_tokens=MAX_TOKENS,
        extra={"vllm_xargs": handles_xargs(i["handle"] for i in encoded)},
    )
    assert wait_for(lambda: _counter(vllm, "loaded_items") == loaded + len(items))
    assert _counter(vllm, "local_encoder_items") == local  # vLLM's encoder stayed idle
    assert len(epd.tokens) == MAX_TOKENS
    assert_greedy_agree(epd, direct, NEAR_TIE_FLOAT32, f"{family} {case}")
    assert_greedy_differ(epd, wrong, NEAR_TIE_FLOAT32, f"{family} {case} against other items' answer")


def test_a_video_with_its_soundtrack_goes_epd_and_answers_like_vllm(stack: tuple[EricServer, VllmServe, str]) -> None:
    """A video with an AAC soundtrack and `use_audio_in_video`: vLLM alone encodes the video and the audio it takes
    from it; then Eric encodes both (the video asked with its soundtrack), the request carries the video's hash as
    its uuid, both handles and the pair, and the connector loads both items: vLLM's encoder stays idle and the greedy
    answer is vLLM's own, not its answer for another such video (the negative control)."""
    eric, vllm, family = stack
    data, other = (
        video_with_audio_bytes(num_frames=8, width=64, height=48, fps=4, rate=RATE, seed=s) for s in (38, 138)
    )
    items, option = (("video", data),), {"mm_processor_kwargs": {"use_audio_in_video": True}}
    before = {k: _counter(vllm, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, _messages(items), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    others = _messages((("video", other),))
    wrong, _ = ask_token_ids(vllm.url, others, key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    local = before["local_encoder_items"] + 4  # each video and its soundtrack
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") == local)
    resp = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=120,
        json={"items": [{"modality": "video", "url": data_url(data, MIME["video"]), "use_audio_in_video": True}]},
    )
    assert resp.status_code == 200, resp.text
    (video,) = resp.json()["items"]
    sound = video["soundtrack"]
    xargs = handles_xargs([video["handle"], sound["handle"]]) | soundtracks_xargs([(video["hash"], sound["hash"])])
    epd, _ = ask_token_ids(
        vllm.url,
        _messages(items, [soundtrack_uuid(video["hash"], sound["hash"])]),  # as the gateway names them
        key=vllm.api_key,
        max_tokens=MAX_TOKENS,
        extra={**option, "vllm_xargs": xargs},
    )
    assert wait_for(lambda: _counter(vllm, "loaded_items") == before["loaded_items"] + 2)
    assert _counter(vllm, "local_encoder_items") == local  # vLLM's encoder stayed idle
    assert len(epd.tokens) == MAX_TOKENS
    assert_greedy_agree(epd, direct, NEAR_TIE_FLOAT32, f"{family} video with its soundtrack")
    assert_greedy_differ(epd, wrong, NEAR_TIE_FLOAT32, f"{family} video with its soundtrack against another's answer")


def test_the_gateway_sends_audio_and_an_image_down_one_epd_path(
    stack: tuple[EricServer, VllmServe, str], tmp_path: Path
) -> None:
    """A clip and an image through the gateway in front of the same servers: the EPD path, both items loaded from
    Eric, and vLLM's own answer, not its answer for another clip and image of the same length and size (the negative
    control)."""
    eric, vllm, family = stack
    items = (_clip(RATE + 91, 36), ("image", image_bytes(random_image(80, 60, seed=37))))
    direct, loaded, _ = _direct(vllm, items)
    wrong, _, local = _direct(vllm, (_clip(RATE + 91, 136), ("image", image_bytes(random_image(80, 60, seed=137)))))
    with _gateway(eric, vllm, tmp_path) as gateway:
        answer, path = ask_token_ids(gateway.url, _messages(items), max_tokens=MAX_TOKENS)
        assert path == "epd"
        assert wait_for(lambda: _counter(vllm, "loaded_items") == loaded + 2)
        assert _counter(vllm, "local_encoder_items") == local
        assert_greedy_agree(answer, direct, NEAR_TIE_FLOAT32, f"{family} audio + image through the gateway")
        assert_greedy_differ(answer, wrong, NEAR_TIE_FLOAT32, f"{family} audio + image against other items' answer")
        for option in (False, True):  # inert here (no video): items still matched by their Eric handles
            extra = {"mm_processor_kwargs": {"use_audio_in_video": option}}
            again, path = ask_token_ids(gateway.url, _messages(items), max_tokens=MAX_TOKENS, extra=extra)
            assert path == "epd"
            assert wait_for(lambda: _counter(vllm, "loaded_items") >= loaded + 2)
            assert _counter(vllm, "local_encoder_items") == local, option  # vLLM encoded nothing itself
            assert_greedy_agree(again, direct, NEAR_TIE_FLOAT32, f"{family} with use_audio_in_video={option}")


def test_the_gateway_sends_a_video_with_its_soundtrack_down_the_epd_path(
    stack: tuple[EricServer, VllmServe, str], tmp_path: Path
) -> None:
    """A video with `use_audio_in_video` through the gateway (one item is enough here): the EPD path, the video and
    its soundtrack loaded from Eric, and vLLM's own answer, not its answer for another such video (the negative
    control)."""
    eric, vllm, family = stack
    items, others = (
        (("video", video_with_audio_bytes(num_frames=8, width=64, height=48, fps=4, rate=RATE, seed=seed)),)
        for seed in (39, 139)
    )
    option = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    before = {k: _counter(vllm, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, _messages(items), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    wrong, _ = ask_token_ids(vllm.url, _messages(others), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    local = before["local_encoder_items"] + 4
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") == local)
    with _gateway(eric, vllm, tmp_path, "--epd-min-items", "1") as gateway:
        answer, path = ask_token_ids(gateway.url, _messages(items), max_tokens=MAX_TOKENS, extra=option)
    assert path == "epd"
    assert wait_for(lambda: _counter(vllm, "loaded_items") == before["loaded_items"] + 2)
    assert _counter(vllm, "local_encoder_items") == local
    assert_greedy_agree(answer, direct, NEAR_TIE_FLOAT32, f"{family} video with its soundtrack through the gateway")
    assert_greedy_differ(
        answer, wrong, NEAR_TIE_FLOAT32, f"{family} video with its soundtrack against another's answer"
    )


def test_two_videos_with_one_soundtrack_share_one_lease_acknowledged_once(
    stack: tuple[EricServer, VllmServe, str], tmp_path: Path
) -> None:
    """Two videos (other frames) with the same soundtrack and `use_audio_in_video`, through the gateway: the two
    soundtracks are one content in Eric (one lease, under two vLLM identifiers: each video's); the connector loads
    it for both and acknowledges the lease once, so the request answers as vLLM alone does, twice in a row, vLLM's
    encoder stays idle, and Eric holds nothing after either; vLLM's answer for two other such videos (other frames,
    another shared soundtrack) fails the same comparison (the negative control)."""
    eric, vllm, family = stack
    items, others = (
        tuple(
            ("video", video_with_audio_bytes(num_frames=8, width=64, height=48, fps=4, rate=RATE, seed=s, audio_seed=a))
            for s in seeds
        )
        for seeds, a in (((40, 41), 42), ((140, 141), 142))
    )
    option = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    before = {k: _counter(vllm, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, _messages(items), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") > before["local_encoder_items"])
    local = _counter(vllm, "local_encoder_items")
    held = lambda: held_bytes(eric.url, eric.headers)  # noqa: E731
    with _gateway(eric, vllm, tmp_path) as gateway:
        for attempt in range(2):
            answer, path = ask_token_ids(gateway.url, _messages(items), max_tokens=MAX_TOKENS, extra=option)
            assert path == "epd", attempt
            assert_greedy_agree(answer, direct, NEAR_TIE_FLOAT32, f"{family} two videos, one soundtrack, {attempt}")
            assert wait_for(lambda: held() == 0), held()  # the shared lease was acknowledged, not kept
    assert _counter(vllm, "loaded_items") > before["loaded_items"]
    assert _counter(vllm, "local_encoder_items") == local  # every row came from Eric
    wrong, _ = ask_token_ids(vllm.url, _messages(others), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)
    assert_greedy_differ(answer, wrong, NEAR_TIE_FLOAT32, f"{family} two videos, one soundtrack, against others'")
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") > local)  # its counts are in before another test's


def test_one_picture_over_two_soundtracks_answers_each_soundtrack(
    stack: tuple[EricServer, VllmServe, str], tmp_path: Path
) -> None:
    """Two videos of the same frames (one content hash) over other soundtracks (a 220 Hz and a 1760 Hz tone), through
    the gateway one after the other: each answers as vLLM alone does for it, so the second is not given the first's
    soundtrack (vLLM names a soundtrack after its video's uuid, which the gateway mints from both hashes). The two
    direct answers differ (the negative control: the comparison tells the soundtracks apart)."""
    eric, vllm, family = stack
    first, second = (
        (("video", video_with_audio_bytes(8, 64, 48, 4, RATE, seed=43, audio_seed=seed, tone=tone)),)
        for seed, tone in ((44, 220.0), (45, 1760.0))
    )
    option = {"mm_processor_kwargs": {"use_audio_in_video": True}}
    direct = [
        ask_token_ids(vllm.url, _messages(items), key=vllm.api_key, max_tokens=MAX_TOKENS, extra=option)[0]
        for items in (first, second)
    ]
    assert_greedy_differ(direct[0], direct[1], NEAR_TIE_FLOAT32, f"{family}: one picture, two soundtracks")
    with _gateway(eric, vllm, tmp_path, "--epd-min-items", "1") as gateway:
        for items, expected, name in zip((first, second), direct, ("first", "second"), strict=True):
            answer, path = ask_token_ids(gateway.url, _messages(items), max_tokens=MAX_TOKENS, extra=option)
            assert path == "epd", name
            assert_greedy_agree(answer, expected, NEAR_TIE_FLOAT32, f"{family}: the {name} soundtrack")
