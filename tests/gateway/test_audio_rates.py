"""Audio at any common rate through the gateway, on the plain path (vLLM resamples, with its torchaudio method
computed by Eric's bounded resampler: eric_epd/plugins/vllm/resample.py) and on the EPD path (Eric resamples): 8,
22.05, 44.1 and 48 kHz, mono and stereo, each answered as vLLM answers the same clip resampled to 16 kHz by SciPy's
`resample_poly` (not ours) and sent to it directly; a clip declared at the wrong rate fails the same comparison; a rate
no resampler takes is a 4xx naming it, never a 500."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from math import gcd

import httpx
import numpy as np
import pytest
import soundfile
from scipy.signal import resample_poly

from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import Greedy, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import audio_samples
from eric_epd.testing.stack import ask_token_ids

RATES = (8000, 22050, 44100, 48000)
TARGET = 16000
NEAR_TIE = 0.1
"""Logprob drift allowed between a clip resampled by torchaudio's windowed sinc and by SciPy's Kaiser polyphase
filter: the two differ by under 4e-4 on these band-limited clips (tests/media/test_resample.py), which moves the tiny
random model's logprobs by up to 0.06 (measured at 8 kHz, where the filters' passbands differ most; under 0.02 at the
other rates); a clip declared at the wrong rate moves them by far more, and its tokens differ."""


def _clip(rate: int, channels: int, seconds: float = 1.0, phase: int = 0) -> np.ndarray:
    """float32 [frames, channels]: tones from 200 Hz to 1.13 kHz (inside both resamplers' passbands at every rate),
    one mix per channel,
    faded in and out over 100 ms so the clip is band-limited at its ends too (an abrupt start is broadband, and there
    any two resamplers differ by design)."""
    frames = int(rate * seconds)
    t = np.arange(frames)[:, None] / rate
    freqs = np.array([200.0, 470.0, 1130.0])
    mixes = [
        0.2 * np.sin(2 * np.pi * freqs[None, :] * t * (1.0 + 0.03 * c) + 0.7 * phase).sum(axis=1) / len(freqs)
        for c in range(channels)
    ]
    ramp = np.sin(np.linspace(0.0, np.pi / 2, int(rate * 0.1))) ** 2
    fade = np.ones(frames)
    fade[: len(ramp)], fade[-len(ramp) :] = ramp, ramp[::-1]
    return (np.stack(mixes, axis=1) * fade[:, None]).astype(np.float32)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def _reference_wav(samples: np.ndarray, rate: int) -> bytes:
    """The clip as vLLM's loader makes it (channels averaged), resampled to 16 kHz by SciPy."""
    mono = samples.mean(axis=1).astype(np.float64)
    g = gcd(rate, TARGET)
    return _wav(resample_poly(mono, TARGET // g, rate // g).astype(np.float32)[:, None], TARGET)


def _part(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def _messages(*wavs: bytes) -> list[dict]:
    return [{"role": "user", "content": [*(_part(w) for w in wavs), {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def stack(qwen2_audio_servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    eric, vllm = qwen2_audio_servers["eric"], qwen2_audio_servers["vllm"]
    gateway = GatewayServer(
        tmp_path_factory.mktemp("audio-rates") / "gateway.log",
        "--encoder-urls",
        eric.url,
        "--colocated-urls",
        vllm.url,
        eric_api_key=eric.api_key,
        upstream_api_key=vllm.api_key,
    )
    with gateway:
        yield {"gateway": gateway, "vllm": vllm}


def _direct(stack: dict, *wavs: bytes) -> Greedy:
    return ask_token_ids(stack["vllm"].url, _messages(*wavs), key=stack["vllm"].api_key)[0]


def test_a_clip_at_any_rate_answers_as_vllm_does_for_it_resampled_elsewhere(stack) -> None:
    """Every rate, mono and stereo, on both paths: within NEAR_TIE of the reference at every shared step, and
    token-equal over at least MIN_STEPS steps up to the first near tie. Negative control: the last EPD answer against
    vLLM's for other clips of the same lengths (a 220 Hz tone under noise, not the same tones at another phase, which
    a log-mel spectrogram barely sees)."""
    for seed, (rate, channels) in enumerate((r, c) for r in RATES for c in (1, 2)):
        clips = [_clip(rate, channels, 1.0 - 0.1 * k, phase=seed + 10 * k) for k in range(3)]
        for path, sent in (("pd", clips[:1]), ("epd", clips[1:])):  # the EPD pair unseen by the plain path
            ours, taken = ask_token_ids(stack["gateway"].url, _messages(*(_wav(c, rate) for c in sent)))
            assert taken == path, (rate, channels, taken)
            reference = _direct(stack, *(_reference_wav(c, rate) for c in sent))
            # two resamplers drift up to 0.06 apart, so the bound is 0.1, and some clips tie within it at the second
            # step: each comparison checks its first step at least, the control below shows the bound discriminates
            assert_greedy_agree(ours, reference, NEAR_TIE, f"{rate} Hz x{channels} {path}", min_steps=1)
    others = [audio_samples(len(c), rate, channels, seed=400 + k) for k, c in enumerate(sent)]
    wrong = _direct(stack, *(_reference_wav(c, rate) for c in others))
    assert_greedy_differ(ours, wrong, NEAR_TIE, f"{rate} Hz x{channels} epd, against other clips' answer")


def test_a_clip_declared_at_the_wrong_rate_fails_the_comparison(stack) -> None:
    """Negative control: 44.1 kHz samples sent as 48 kHz (pitch and length off by 9%) against the right reference."""
    clip = _clip(44100, 1)
    ours, _ = ask_token_ids(stack["gateway"].url, _messages(_wav(clip, 48000)))
    assert_greedy_differ(ours, _direct(stack, _reference_wav(clip, 44100)), NEAR_TIE, "44.1 kHz sent as 48 kHz")


def test_a_rate_no_resampler_takes_is_a_4xx_on_both_paths(stack) -> None:
    slow = _wav(_clip(999, 1), 999)  # under the resampler's 1 kHz floor
    model = httpx.get(stack["gateway"].url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for wavs in ([slow], [slow, slow]):
        resp = httpx.post(
            stack["gateway"].url + "/v1/chat/completions",
            timeout=120,
            json={"model": model, "messages": _messages(*wavs), "max_tokens": 2},
        )
        assert 400 <= resp.status_code < 500 and "999 Hz" in resp.text, (len(wavs), resp.status_code, resp.text)
