"""Audio items before the tower: decoding (media/audio.py) gives the very samples vLLM 0.32's own loader gives for the
same bytes (wav, flac, mp3, ogg through libsndfile; AAC through PyAV), the resampler is the windowed sinc vLLM asks
torchaudio for, Eric's features are the model's own processor's on them (odd lengths, rates, channel counts, past the
extractor's 30 s), and every limit is a 4xx that names its flag."""

from __future__ import annotations

import io
import math
import threading
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from eric_epd.eric.processor import Processor
from eric_epd.media.audio import decode_audio
from eric_epd.media.limits import MediaLimits
from eric_epd.media.resample import resample
from eric_epd.media.url_policy import MediaError
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.registry import load_processor
from eric_epd.testing.media import audio_bytes, audio_samples

CASES = [("wav", 22050, 2, 5001), ("flac", 44100, 3, 7777), ("mp3", 44100, 2, 9999), ("ogg", 8000, 1, 3333)]
"""(format, rate, channels, frames): odd lengths, rates other than the model's 16 kHz, mono to three channels."""


def _vllm_load(data: bytes) -> tuple[np.ndarray, float]:
    """What vLLM 0.32's AudioMediaIO.load_bytes computes for `data` (its default backend chain, native rate, mono)."""
    from vllm.multimodal.media.audio import load_audio

    return load_audio(io.BytesIO(data), sr=None)


def _pyav_audio(codec: str, fmt: str, container: str, rate: int = 16000) -> bytes:
    """Half a second of stereo `audio_samples` encoded by FFmpeg (containers libsndfile does not open)."""
    samples = audio_samples(rate // 2 + 3, rate, 2).T.copy()
    planar = av.AudioFormat(fmt).is_planar
    data = samples if planar else samples.T.reshape(1, -1).copy()
    if fmt.startswith("s16"):
        data = (data * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=fmt, layout="stereo")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(("fmt", "rate", "channels", "frames"), CASES)
def test_decoding_gives_the_samples_vllms_loader_gives(fmt: str, rate: int, channels: int, frames: int) -> None:
    data = audio_bytes(frames, rate, channels, fmt)
    ours = decode_audio(data, MediaLimits())
    theirs, their_rate = _vllm_load(data)
    assert (ours.sample_rate, ours.channels) == (their_rate, channels) == (rate, channels)
    assert ours.samples.dtype == np.float32 and ours.samples.ndim == 1
    np.testing.assert_array_equal(ours.samples, theirs)  # one library, one process: the same samples
    if fmt in ("wav", "flac"):  # lossless: the written samples, averaged over channels, within PCM quantization
        written = audio_samples(frames, rate, channels).mean(axis=1)
        assert np.abs(ours.samples - written).max() <= 2.0**-15


def test_formats_libsndfile_does_not_open_take_pyav_as_in_vllm() -> None:
    aac = _pyav_audio("aac", "fltp", "mp4")
    ours = decode_audio(aac, MediaLimits())
    theirs, rate = _vllm_load(aac)
    assert ours.sample_rate == rate == 16000 and ours.channels == 2
    np.testing.assert_array_equal(ours.samples, theirs)
    # integer interleaved PCM in Matroska: vLLM's PyAV loader reads it as unscaled, interleaved integers (not audio),
    # so Eric refuses it rather than answer with other samples than vLLM's
    pcm = _pyav_audio("pcm_s16le", "s16", "matroska")
    garbled, _ = _vllm_load(pcm)
    assert np.abs(garbled).max() > 1000 and garbled.shape[0] == 2 * (16000 // 2 + 3)
    with pytest.raises(MediaError) as caught:
        decode_audio(pcm, MediaLimits())
    assert caught.value.status == 400 and "unsupported audio encoding" in caught.value.message


def _direct_sinc(x: np.ndarray, orig: int, target: int) -> np.ndarray:
    """The windowed-sinc resampler written out in float64: y[j] = sum_i x[i] h(i / orig - j / target), h the sinc at
    0.99 of the lower Nyquist rate under a Hann window spanning 6 zero crossings each side."""
    cutoff = min(orig, target) * 0.99
    j = np.arange(math.ceil(target * len(x) / orig))[:, None]
    t = np.clip((np.arange(len(x))[None, :] / orig - j / target) * cutoff, -6, 6)
    kernel = np.sinc(t) * np.cos(t * math.pi / 12) ** 2 * (cutoff / orig)
    return kernel @ x


@pytest.mark.parametrize("orig", [44100, 22050, 11025, 8000, 48000, 4001, 44101])
def test_resampler_is_the_windowed_sinc(orig: int) -> None:
    x = audio_samples(orig // 10 + 7, orig)[:, 0]
    ours = resample(x, orig, 16000)
    assert ours.dtype == np.float32 and ours.shape == (math.ceil(16000 * len(x) / orig),)
    # within 5e-5 of float64: the phases are float32, as torchaudio computes them (measured <= 1.6e-5)
    assert np.abs(ours - _direct_sinc(x.astype(np.float64), orig, 16000)).max() <= 5e-5
    assert resample(x, 16000, 16000) is x


FEATURE_CASES = [
    ("wav", 16000, 1, 2 * 16000 + 1),
    ("flac", 44100, 2, 3 * 44100 + 17),
    ("ogg", 22050, 3, 5439),
    ("mp3", 16000, 2, 31 * 16000),
]
"""Odd lengths at 16 kHz and other rates, one to three channels, and a clip past the extractor's 30 s."""


@pytest.fixture(scope="module")
def processor(qwen2_audio_tiny: Path):
    processor = Processor(load_processor(qwen2_audio_tiny), MediaLimits(), 1, b"test")
    yield processor
    processor.close()


@pytest.mark.parametrize(("fmt", "rate", "channels", "frames"), FEATURE_CASES)
def test_features_are_the_model_processors(
    processor: Processor, qwen2_audio_tiny: Path, fmt: str, rate: int, channels: int, frames: int
) -> None:
    from transformers import AutoProcessor

    data = audio_bytes(frames, rate, channels, fmt, seed=frames)
    item = processor._prepare_sync("audio", data).item
    ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
    samples, their_rate = _vllm_load(data)  # vLLM's samples, resampled, through the model's processor as vLLM calls it
    hf = AutoProcessor.from_pretrained(qwen2_audio_tiny)
    ref = hf(
        text=["<|audio_bos|><|AUDIO|><|audio_eos|>"],
        audio=[resample(samples, int(their_rate), 16000)],
        sampling_rate=16000,
        truncation=True,
        return_tensors="pt",
    )
    assert set(ours) == {"input_features", "feature_attention_mask"}
    assert ours["input_features"].shape == ref["input_features"].shape == (1, 128, 3000)
    assert float((ours["input_features"] - ref["input_features"]).abs().max()) <= 1e-5
    assert torch.equal(ours["feature_attention_mask"], ref["feature_attention_mask"])
    assert item.num_tokens == int((ref["input_ids"] == hf.audio_token_id).sum())
    expected_frames = min(math.ceil(math.ceil(frames * 16000 / rate) / 160), 3000)  # 10 ms mel frames, cut at 30 s
    assert int(ours["feature_attention_mask"].sum()) == expected_frames
    assert item.num_tokens == ((expected_frames - 1) // 2 + 1 - 2) // 2 + 1


def test_an_item_too_short_for_any_token_is_refused(processor: Processor) -> None:
    with pytest.raises(MediaError) as caught:
        processor._prepare_sync("audio", audio_bytes(300, 16000))  # one mel frame: no audio token
    assert caught.value.status == 400 and "too short" in caught.value.message


def test_a_rate_the_resampler_refuses_is_a_413_naming_its_limits(processor: Processor) -> None:
    with pytest.raises(MediaError) as caught:  # decodes (no flag caps low rates), then the resampler refuses it
        processor._prepare_sync("audio", audio_bytes(999, 999))
    assert caught.value.status == 413 and "999 Hz" in caught.value.message
    assert "MIN_SAMPLE_RATE" in caught.value.message, caught.value.message


def _refused(data: bytes, limits: MediaLimits, named: str, stop: threading.Event | None = None) -> int:
    with pytest.raises(MediaError) as caught:
        decode_audio(data, limits, stop)
    assert named in caught.value.message, caught.value.message
    return caught.value.status


def test_every_limit_is_a_4xx_naming_it() -> None:
    six_seconds = audio_bytes(6 * 8000, 8000, 3)
    assert _refused(six_seconds, MediaLimits(max_audio_seconds=5), "--max-audio-seconds") == 413
    assert _refused(six_seconds, MediaLimits(max_audio_channels=2), "--max-audio-channels") == 413
    assert _refused(six_seconds, MediaLimits(max_audio_sample_rate=4000), "--max-audio-sample-rate") == 413
    assert (
        _refused(six_seconds, MediaLimits(max_audio_decode_bytes=6 * 8000 * 3 * 4 - 1), "--max-audio-decode-bytes")
        == 413
    )
    assert decode_audio(six_seconds, MediaLimits(max_audio_seconds=6, max_audio_channels=3)).samples.shape == (48000,)
    assert _refused(b"RIFF not really a wave file" * 8, MediaLimits(), "could not decode audio") == 400
    assert _refused(b"", MediaLimits(), "empty") == 400
    gone = threading.Event()
    gone.set()
    assert _refused(six_seconds, MediaLimits(), "cancelled", stop=gone) == 499
    with pytest.raises(ValueError, match="positive"):
        MediaLimits(max_audio_channels=0)
    with pytest.raises(ValueError, match="at most 192000 Hz"):
        MediaLimits(max_audio_sample_rate=192001)
