"""Audio through the gateway: `input_audio` and `audio_url` parts are media items (counted for --epd-min-items, their
URLs under the URL policy). Qwen2-Audio (tiny, offline) behind real Eric and real `vllm serve` with the connector:
two clips go EPD and one clip the plain path, both answering what vLLM answers on its own; a model without audio
(Qwen2-VL) gets a 400 naming audio and keeps serving. A request with audio and images takes one path, all its items
to the Erics or none (checked here on the gateway's own decision; a real one, Qwen2.5-Omni's clip and image down the
EPD path, in tests/vllm/test_omni_epd.py). A video with `use_audio_in_video` (the one processor option a client may
set) goes to the Erics asking for its soundtrack, and the engine gets the option, both handles and the pair; Erics
without audio leave it to the engine, and a model without audio or another option is a 400."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from epd_gateway.config import GatewayConfig
from epd_gateway.content import MediaRef, collect_media
from epd_gateway.encoders import EncoderState
from epd_gateway.gateway import Gateway
from epd_gateway.metrics import GatewayMetrics
from epd_gateway.upstream import new_session
from starlette.responses import Response

from eric_epd.common.errors import ApiError
from eric_epd.media.url_policy import UrlPolicy
from eric_epd.models.facts import has_audio_tower
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import audio_bytes, data_url, image_data_url, video_bytes
from eric_epd.testing.stack import ask_token_ids, image_messages, metric, wait_for
from eric_epd.wire.eric import GRID, MEDIA, EncodedItem
from eric_epd.wire.handoff import EXTRA_ARGS_KEY, SOUNDTRACKS_KEY, soundtrack_uuid
from tests.support.encoded import encoded

RATE = 16000
"""vLLM resamples with torchaudio, which this venv cannot load: every clip is at the model's 16 kHz."""
MAX_TOKENS = 8


def _audio_part(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def _messages(parts: list[dict], text: str = "What do you hear?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _clips(*specs: tuple[int, int]) -> list[dict]:
    """An input_audio part per (frames at 16 kHz, seed)."""
    return [_audio_part(audio_bytes(frames, RATE, 1, "wav", seed=seed)) for frames, seed in specs]


# ---------------------------------------------------------------- parsing and the one-path decision (no servers)


def test_audio_parts_are_media_items_under_the_url_policy() -> None:
    wav = audio_bytes(RATE // 4, RATE, seed=1)
    body = {
        "messages": _messages(
            [_audio_part(wav), {"type": "audio_url", "audio_url": {"url": data_url(wav, "audio/wav")}}]
        )
    }
    refs = collect_media(body, UrlPolicy(), max_items=4)
    assert [(r.part, r.modality, r.part_type) for r in refs] == [(0, "audio", "input_audio"), (1, "audio", "audio_url")]
    assert refs[0].url == "data:audio/wav;base64," + base64.b64encode(wav).decode()  # what vLLM makes of the part
    with pytest.raises(ApiError, match="too many media items: 2 > 1"):
        collect_media(body, UrlPolicy(), max_items=1)
    remote = {"messages": _messages([{"type": "audio_url", "audio_url": {"url": "http://10.0.0.1/a.wav"}}])}
    with pytest.raises(ApiError, match="private/loopback/reserved address; refused"):
        collect_media(remote, UrlPolicy(), max_items=4)
    bad = {"messages": _messages([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav;x"}}])}
    with pytest.raises(ApiError, match="'input_audio' needs a 'format'"):
        collect_media(bad, UrlPolicy(), max_items=4)


def test_a_model_takes_audio_where_its_config_has_an_audio_tower() -> None:
    """What an Eric's card says as `takes_audio`, whether Eric encodes the audio (Qwen2-Audio) or not (an Omni
    thinker's, a Gemma whose checkpoint has no audio tower)."""
    assert has_audio_tower({"model_type": "qwen2_audio", "audio_config": {"d_model": 64}})
    assert has_audio_tower({"model_type": "qwen2_5_omni", "thinker_config": {"audio_config": {"d_model": 64}}})
    assert not has_audio_tower({"model_type": "gemma4", "audio_config": None, "vision_config": {}})
    assert not has_audio_tower({"model_type": "qwen2_vl", "vision_config": {}})


def _chat(cards: list[EncoderState], body: dict, min_items: int = 2) -> tuple[str, list[MediaRef], dict]:
    """Gateway.chat with these Eric cards, each encode answered by a fake Eric (a video sent with its soundtrack
    answered with one) and the engine by a fake vLLM: the path, the refs sent to the Erics and the body the engine
    got."""
    sent: list[MediaRef] = []
    engine: dict[str, Any] = {}

    async def carded() -> list[EncoderState]:
        return cards

    async def encode(refs: list[MediaRef], _leases: object) -> tuple[list[EncodedItem], int]:
        sent.extend(refs)
        return [
            encoded(
                f"{i:064x}",
                placement=MEDIA,
                lease=f"t{i}",
                soundtrack=encoded(f"{i + 100:064x}", lease=f"s{i}") if r.with_audio else None,
            )
            for i, r in enumerate(refs)
        ], 1

    async def complete(_path: str, out: dict, _headers: dict, _raw: bytes | None = None, **_: Any) -> Response:
        engine.update(out if _raw is None else orjson.loads(_raw))
        return Response(orjson.dumps({"choices": [{"finish_reason": "length"}]}), media_type="application/json")

    async def run() -> str:
        config = GatewayConfig(
            encoder_urls=tuple(c.url for c in cards), colocated_urls=("http://127.0.0.1:9",), epd_min_items=min_items
        )
        metrics = GatewayMetrics()
        async with httpx.AsyncClient() as client, new_session(config) as session:
            gateway = Gateway(config, client, session, metrics, client, session)
            gateway.encoders.carded = carded  # type: ignore[method-assign]
            gateway.encoders.encode = encode  # type: ignore[method-assign]
            gateway.upstreams.complete = complete  # type: ignore[method-assign]
            path, _ = await gateway.chat(orjson.dumps(body), body, {})
            await gateway.inliner.aclose()
            return path

    return asyncio.run(run()), sent, engine


def _mixed() -> dict:
    wav = audio_bytes(RATE // 2, RATE, seed=2)
    return {
        "model": "omni",
        "messages": _messages(
            [{"type": "image_url", "image_url": {"url": image_data_url(32, 32, seed=3)}}, _audio_part(wav)]
        ),
    }


def test_audio_and_images_take_one_path() -> None:
    """Erics that encode both: both items go to them and both parts reach the engine keyed by Eric's hash; Erics
    that encode images only: neither item goes there and the engine gets the client's parts as they were."""
    both = [EncoderState("http://e1", modalities=frozenset({"image", "audio"}), placement=MEDIA, takes_audio=True)]
    path, sent, engine = _chat(both, _mixed())
    assert path == "epd"
    assert [r.modality for r in sent] == ["image", "audio"]
    parts = engine["messages"][0]["content"]
    assert [(p["type"], p.get("uuid")) for p in parts] == [
        ("image_url", f"{0:064x}"),
        ("input_audio", f"{1:064x}"),
        ("text", None),
    ]
    assert [h["lease"] for h in orjson.loads(engine["vllm_xargs"][EXTRA_ARGS_KEY])] == ["t0", "t1"]

    images_only = [EncoderState("http://e1", modalities=frozenset({"image"}), placement=GRID, takes_audio=True)]
    path, sent, engine = _chat(images_only, _mixed())
    assert (path, sent) == ("pd", [])
    assert engine["messages"] == _mixed()["messages"] and "vllm_xargs" not in engine


def test_audio_to_a_model_without_audio_is_refused() -> None:
    no_audio = [EncoderState("http://e1", modalities=frozenset({"image", "video"}), takes_audio=False)]
    with pytest.raises(ApiError, match="the model 'omni' does not take audio") as e:
        _chat(no_audio, _mixed())
    assert e.value.status == 400
    unknown = [EncoderState("http://e1", modalities=frozenset({"image", "video"}))]  # an Eric that does not say
    assert _chat(unknown, _mixed())[0] == "pd"  # the engine's own answer tells


def _talkie(option: object = True) -> dict:
    """A video and an image, and vLLM's option that gives the video's soundtrack to the model too."""
    parts = [
        {"type": "video_url", "video_url": {"url": data_url(video_bytes(num_frames=2), "video/mp4")}},
        {"type": "image_url", "image_url": {"url": image_data_url(32, 32, seed=4)}},
    ]
    return {"model": "omni", "messages": _messages(parts), "mm_processor_kwargs": {"use_audio_in_video": option}}


OMNI_ERIC = EncoderState(
    "http://e1", modalities=frozenset({"image", "video", "audio"}), placement=MEDIA, takes_audio=True
)


def test_a_video_with_its_soundtrack_goes_epd_with_both_handles_and_the_pair() -> None:
    """The video goes to the Erics asking for its soundtrack; the engine gets the option, the video keyed by its
    hash and its soundtrack's (soundtrack_uuid), every handle (the soundtrack's too) and which is which video's
    soundtrack."""
    path, sent, engine = _chat([OMNI_ERIC], _talkie())
    assert path == "epd"
    assert [(r.modality, r.with_audio) for r in sent] == [("video", True), ("image", False)]
    assert engine["mm_processor_kwargs"] == {"use_audio_in_video": True}
    assert engine["messages"][0]["content"][0]["uuid"] == soundtrack_uuid(f"{0:064x}", f"{100:064x}")
    assert [h["lease"] for h in orjson.loads(engine["vllm_xargs"][EXTRA_ARGS_KEY])] == ["t0", "t1", "s0"]
    assert orjson.loads(engine["vllm_xargs"][SOUNDTRACKS_KEY]) == [[f"{0:064x}", f"{100:064x}"]]
    path, sent, engine = _chat([OMNI_ERIC], _talkie(False))
    assert path == "epd" and not any(r.with_audio for r in sent) and SOUNDTRACKS_KEY not in engine["vllm_xargs"]
    assert "mm_processor_kwargs" not in engine  # inert, and it would rename every item vLLM hashes


def test_an_inert_processor_option_is_not_forwarded() -> None:
    """vLLM hashes a request's processor options into every item's identifier: `use_audio_in_video` false, or true
    with no video in the request, changes nothing the engine computes, so the engine never gets it (forwarded, no
    Eric handle would match its items); true with a video reaches it (the connector keys handles for it)."""
    for option, body in ((False, _mixed()), (True, _mixed())):
        path, _, engine = _chat([OMNI_ERIC], {**body, "mm_processor_kwargs": {"use_audio_in_video": option}})
        assert path == "epd" and "mm_processor_kwargs" not in engine, option
    path, _, engine = _chat([OMNI_ERIC], _talkie(True))
    assert engine["mm_processor_kwargs"] == {"use_audio_in_video": True}


def test_a_soundtrack_the_erics_cannot_encode_takes_the_plain_path_or_a_400() -> None:
    """Erics that encode no audio: the whole request to the engine as it came (option included); a model without
    audio: a 400; any other processor option: a 400 naming the field."""
    vision = EncoderState("http://e1", modalities=frozenset({"image", "video"}), placement=MEDIA, takes_audio=True)
    path, sent, engine = _chat([vision], _talkie())
    assert (path, sent, engine["mm_processor_kwargs"]) == ("pd", [], {"use_audio_in_video": True})
    deaf = EncoderState("http://e1", modalities=frozenset({"image", "video"}), takes_audio=False)
    with pytest.raises(ApiError, match="does not take audio"):
        _chat([deaf], _talkie())
    for body in (_talkie("yes"), {**_talkie(), "mm_processor_kwargs": {"use_audio_in_video": True, "fps": 1}}):
        with pytest.raises(ApiError, match="mm_processor_kwargs") as e:
            _chat([OMNI_ERIC], body)
        assert e.value.status == 400


# ---------------------------------------------------------------- real Eric, vLLM and gateway


@pytest.fixture(scope="module")
def stack(qwen2_audio_servers: dict):
    """The session's Qwen2-Audio Eric and `vllm serve` (connector), the gateway in front (--epd-min-items 2, the
    default)."""
    eric, vllm = qwen2_audio_servers["eric"], qwen2_audio_servers["vllm"]
    with GatewayServer(
        None,
        "--encoder-urls",
        eric.url,
        "--colocated-urls",
        vllm.url,
        eric_api_key=eric.api_key,
        upstream_api_key=vllm.api_key,
    ) as gateway:
        yield {"eric": eric, "vllm": vllm, "gateway": gateway}


@pytest.mark.exactness
def test_two_clips_go_epd_and_one_clip_the_plain_path_answering_like_vllm(stack) -> None:
    """Each request straight to vLLM (its own encoder), then through the gateway: two clips go EPD (the connector
    loads both clips' rows from Eric), one clip goes as it came; the greedy answers are vLLM's own, and not vLLM's
    answer for clips of the same lengths from other seeds."""
    gw, vllm = stack["gateway"].url, stack["vllm"]
    for specs, want in ((((RATE + 101, 21), (2 * RATE + 5, 22)), "epd"), (((3 * RATE // 2, 23),), "pd")):
        clips = _clips(*specs)
        msgs = _messages(clips)
        direct, _ = ask_token_ids(vllm.url, msgs, key=vllm.api_key, max_tokens=MAX_TOKENS)
        loaded = metric(vllm.url, "vllm:eric_ec_loaded_items_total")
        answer, path = ask_token_ids(gw, msgs, max_tokens=MAX_TOKENS)
        assert path == want
        expected = loaded + (len(clips) if want == "epd" else 0)
        assert wait_for(lambda: metric(vllm.url, "vllm:eric_ec_loaded_items_total") == expected)  # noqa: B023
        assert len(answer.tokens) == MAX_TOKENS
        assert_greedy_agree(answer, direct, NEAR_TIE_FLOAT32, f"{len(clips)} clip(s) through the gateway")
        others = _messages(_clips(*((frames, seed + 40) for frames, seed in specs)))
        wrong, _ = ask_token_ids(vllm.url, others, key=vllm.api_key, max_tokens=MAX_TOKENS)
        label = f"{len(clips)} clip(s) through the gateway, against other clips' answer"
        assert_greedy_differ(answer, wrong, NEAR_TIE_FLOAT32, label)


@pytest.mark.exactness
@pytest.mark.parametrize("option", [False, True])
def test_an_inert_processor_option_keeps_the_epd_path_and_vllms_answer(stack, option: bool) -> None:
    """Two clips with `mm_processor_kwargs: {"use_audio_in_video": ...}` (inert for Qwen2-Audio, which takes no
    video): the gateway does not forward it, so vLLM names the items by Eric's hashes; both clips' rows are loaded
    from Eric and the answer is vLLM's own for the same clips without the option, not its answer for other clips of
    the same lengths."""
    gw, vllm = stack["gateway"].url, stack["vllm"]
    specs = ((RATE + 301 + option, 25 + 2 * option), (RATE + 7, 26 + 2 * option))
    msgs = _messages(_clips(*specs))
    direct, _ = ask_token_ids(vllm.url, msgs, key=vllm.api_key, max_tokens=MAX_TOKENS)
    loaded = metric(vllm.url, "vllm:eric_ec_loaded_items_total")
    answer, path = ask_token_ids(
        gw, msgs, max_tokens=MAX_TOKENS, extra={"mm_processor_kwargs": {"use_audio_in_video": option}}
    )
    assert path == "epd"
    assert wait_for(lambda: metric(vllm.url, "vllm:eric_ec_loaded_items_total") == loaded + 2)
    assert_greedy_agree(answer, direct, NEAR_TIE_FLOAT32, f"use_audio_in_video={option} through the gateway")
    others = _messages(_clips(*((frames, seed + 40) for frames, seed in specs)))
    wrong, _ = ask_token_ids(vllm.url, others, key=vllm.api_key, max_tokens=MAX_TOKENS)
    label = f"use_audio_in_video={option} through the gateway, against other clips' answer"
    assert_greedy_differ(answer, wrong, NEAR_TIE_FLOAT32, label)


def test_audio_urls_pass_the_url_policy(stack) -> None:
    gw = stack["gateway"].url
    for url, status, says in (
        ("http://10.0.0.1/clip.wav", 400, "private/loopback/reserved address; refused"),
        ("file:///tmp/clip.wav", 403, "file:// URLs are disabled (no file roots configured)"),
    ):
        parts = [{"type": "audio_url", "audio_url": {"url": url}}, *_clips((RATE, 24))]
        resp = httpx.post(
            gw + "/v1/chat/completions", timeout=60, json={"model": "m", "messages": _messages(parts), "max_tokens": 2}
        )
        assert resp.status_code == status, resp.text
        assert says in resp.json()["error"]["message"]


def test_audio_to_an_image_model_is_refused_and_the_gateway_keeps_serving(vllm_behind_erics, tmp_path: Path) -> None:
    """Qwen2-VL's Erics say their model takes no audio: a 400 naming it, before anything is encoded; the next
    request, two images, goes EPD and answers."""
    erics, vllm = vllm_behind_erics["erics"], vllm_behind_erics["vllm"]
    with GatewayServer(
        tmp_path / "gateway.log",
        "--encoder-urls",
        ",".join(e.url for e in erics),
        "--colocated-urls",
        vllm.url,
        eric_api_key=vllm_behind_erics["eric_key"],
        upstream_api_key=vllm.api_key,
    ) as gateway:
        resp = httpx.post(
            gateway.url + "/v1/chat/completions",
            timeout=60,
            json={"model": "qwen2-vl", "messages": _messages(_clips((RATE, 25))), "max_tokens": 2},
        )
        assert resp.status_code == 400, resp.text
        assert "'qwen2-vl' does not take audio" in resp.json()["error"]["message"]
        msgs = image_messages([image_data_url(64, 48, seed=26), image_data_url(48, 64, seed=27)])
        answer, path = ask_token_ids(gateway.url, msgs, max_tokens=4)
        assert path == "epd" and len(answer.tokens) == 4
