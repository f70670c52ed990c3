"""Qwen2-Audio EPD through real `vllm serve` behind a real Eric (tiny offline checkpoint): `input_audio` parts keep
their data (vLLM's processor lays out the placeholder from it) and carry Eric's content hash as their uuid, Eric's
handles ride in `vllm_xargs`, and the connector fills each placeholder with Eric's rows (vLLM's encoder stays idle);
the answer is token for token the one the same vLLM gives the same request without uuids or handles, with its own
encoder (up to the first near tie). Clips are at 16 kHz: vLLM resamples with torchaudio, which this venv cannot load
(tests/vllm/test_audio_placeholders.py)."""

from __future__ import annotations

import base64

import httpx
import pytest

from eric_epd.stack.servers import EricServer, VllmServe
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import audio_bytes, data_url
from eric_epd.testing.stack import ask_token_ids, metric, wait_for
from eric_epd.wire.handoff import handles_xargs

pytestmark = pytest.mark.exactness

RATE = 16000
MAX_TOKENS = 8
CASES = {"one_clip": ((2 * RATE + 1, 11),), "two_clips": ((RATE + 333, 12), (3 * RATE + 7, 13))}
"""Case -> (frames at 16 kHz, seed) per clip: odd lengths, and no clip in two cases (neither of vLLM's caches holds
a case's audio when it is asked)."""
OTHER_SEED = 100
"""Added to each clip's seed for the negative control's clips: the same lengths, other noise."""


@pytest.fixture(scope="module")
def stack(qwen2_audio_servers: dict) -> tuple[EricServer, VllmServe]:
    """The session's Qwen2-Audio Eric and `vllm serve` with the connector behind it."""
    return qwen2_audio_servers["eric"], qwen2_audio_servers["vllm"]


def _messages(wavs: list[bytes], uuids: list[str] | None = None) -> list[dict]:
    """One user turn: each clip as an OpenAI `input_audio` part (with its uuid, if given), then the text."""
    parts = []
    for n, wav in enumerate(wavs):
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
        parts.append(part | ({"uuid": uuids[n]} if uuids else {}))
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What do you hear?"}]}]


def _counter(vllm: VllmServe, name: str) -> float:
    return metric(vllm.url, f"vllm:eric_ec_{name}_total")


@pytest.mark.parametrize("case", CASES)
def test_audio_goes_epd_as_media_and_answers_like_vllm(stack: tuple[EricServer, VllmServe], case: str) -> None:
    """The clips straight to vLLM (its own encoder runs once per clip), then the same clips encoded by Eric and sent
    with its hashes and handles: the connector loads every clip's rows from Eric, vLLM's encoder runs no more, and
    the greedy answer is vLLM's own. Negative control: the EPD answer fails the same comparison with vLLM's answer
    for clips of the same lengths with other noise."""
    eric, vllm = stack
    wavs = [audio_bytes(frames, RATE, 1, "wav", seed=seed) for frames, seed in CASES[case]]
    others = [audio_bytes(frames, RATE, 1, "wav", seed=seed + OTHER_SEED) for frames, seed in CASES[case]]
    before = {k: _counter(vllm, k) for k in ("loaded_items", "local_encoder_items")}
    direct, _ = ask_token_ids(vllm.url, _messages(wavs), key=vllm.api_key, max_tokens=MAX_TOKENS)
    wrong, _ = ask_token_ids(vllm.url, _messages(others), key=vllm.api_key, max_tokens=MAX_TOKENS)
    local = before["local_encoder_items"] + 2 * len(wavs)
    assert wait_for(lambda: _counter(vllm, "local_encoder_items") == local)
    assert _counter(vllm, "loaded_items") == before["loaded_items"]

    resp = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=120,
        json={"items": [{"modality": "audio", "url": data_url(w, "audio/wav")} for w in wavs]},
    )
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    assert [(i["modality"], i["placement"]) for i in items] == [("audio", "media")] * len(wavs)
    xargs = handles_xargs(i["handle"] for i in items)
    epd, _ = ask_token_ids(
        vllm.url,
        _messages(wavs, [i["hash"] for i in items]),
        key=vllm.api_key,
        max_tokens=MAX_TOKENS,
        extra={"vllm_xargs": xargs},
    )
    assert wait_for(lambda: _counter(vllm, "loaded_items") == before["loaded_items"] + len(wavs))
    assert _counter(vllm, "local_encoder_items") == local  # vLLM's encoder stayed idle
    assert len(epd.tokens) == MAX_TOKENS
    assert_greedy_agree(epd, direct, NEAR_TIE_FLOAT32, f"qwen2_audio {case}")
    assert_greedy_differ(epd, wrong, NEAR_TIE_FLOAT32, f"qwen2_audio {case} against other clips' answer")
