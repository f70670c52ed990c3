"""Bounded audio decoding for Eric's preprocessing, giving the samples vLLM 0.32's audio loader gives for the same
bytes (`vllm/multimodal/media/audio.py: load_audio`, native rate, mono): libsndfile through soundfile (wav, flac, ogg,
mp3, ...), else FFmpeg through PyAV with the demuxer the container sniff chose (never probing); channels averaged.
Synchronous, meant for a thread pool."""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import dataclass

import av
import numpy as np
import soundfile

from eric_epd.media.demux import open_for_decoding, sniff_for_decoding
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError

logger = logging.getLogger(__name__)

UNRECOGNISED = frozenset({0, 1, 3, 4})
"""libsndfile error codes on which vLLM's loader tries PyAV next (unrecognised, malformed or unsupported data; 0 is
libsndfile's garbled error under concurrent failures); any other is a decode error."""
FLOAT_FORMATS = frozenset({"flt", "fltp", "dbl", "dblp"})
"""PyAV sample formats whose raw frames vLLM's PyAV loader reads as audio: an integer or interleaved multi-channel
frame reaches it as unscaled integers or interleaved channels, so Eric refuses those rather than differ."""


@dataclass(frozen=True)
class DecodedAudio:
    """One audio item: mono float32 samples at the source's own rate."""

    samples: np.ndarray
    sample_rate: int
    channels: int
    """Channels in the source (averaged into `samples`)."""


def decode_audio(data: bytes, limits: MediaLimits, stop: threading.Event | None = None) -> DecodedAudio:
    """Decode `data` as vLLM's loader does (soundfile, else PyAV). 400 for undecodable or empty audio and for a
    container outside `containers.AUDIO_DEMUXERS`; 413 for a source over the sample-rate, channel, duration or
    decoded-size limits, checked from its header before decoding and again on what was decoded; 499 once `stop` is
    set (the requester has gone)."""
    if not data:
        raise MediaError(400, "audio is empty (0 bytes)")
    demuxer = sniff_for_decoding(data, "audio")
    _check_stop(stop)
    try:
        decoded = _decode_soundfile(data, limits)
    except soundfile.LibsndfileError as exc:
        if exc.code not in UNRECOGNISED:
            raise MediaError(400, f"could not decode audio: {exc.error_string}") from exc
        decoded = _decode_pyav(data, demuxer, limits, stop)
    except (RuntimeError, ValueError, TypeError) as exc:  # libsndfile giving up mid-stream, or a header it rejects
        raise MediaError(400, f"could not decode audio: {str(exc) or type(exc).__name__}") from exc
    if decoded.samples.size == 0:
        raise MediaError(400, "could not decode audio: it holds no samples")
    _check_length(decoded.samples.shape[-1], decoded.sample_rate, decoded.channels, limits)
    return decoded


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise MediaError(499, "the request was cancelled while its audio was decoding")


def _check_header(sample_rate: int, channels: int, limits: MediaLimits) -> None:
    """413 naming the flag for a source over the sample-rate or channel limit; 400 for a header without either."""
    if sample_rate <= 0 or channels <= 0:
        raise MediaError(400, f"could not decode audio: its header says {sample_rate} Hz, {channels} channels")
    if sample_rate > limits.max_audio_sample_rate:
        raise MediaError(
            413,
            f"the audio is sampled at {sample_rate} Hz, over the limit of "
            f"{limits.max_audio_sample_rate} Hz (--max-audio-sample-rate)",
        )
    if channels > limits.max_audio_channels:
        raise MediaError(
            413,
            f"the audio has {channels} channels, over the limit of {limits.max_audio_channels} (--max-audio-channels)",
        )


def _check_length(frames: int, sample_rate: int, channels: int, limits: MediaLimits) -> None:
    """413 naming the flag when `frames` samples per channel run over the duration or decoded-size limit."""
    if frames / sample_rate > limits.max_audio_seconds:
        raise MediaError(
            413,
            f"the audio is {frames / sample_rate:.1f} s long, over the limit of "
            f"{limits.max_audio_seconds:g} s (--max-audio-seconds)",
        )
    if frames * channels * 4 > limits.max_audio_decode_bytes:
        raise MediaError(
            413,
            f"the audio decodes to {frames * channels * 4} bytes of float32 samples, over the "
            f"limit of {limits.max_audio_decode_bytes} (--max-audio-decode-bytes)",
        )


def _decode_soundfile(data: bytes, limits: MediaLimits) -> DecodedAudio:
    """vLLM's `load_audio_soundfile(sr=None)`: the whole file as float32, [channels, frames], averaged over
    channels."""
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        _check_header(f.samplerate, f.channels, limits)
        _check_length(f.frames, f.samplerate, f.channels, limits)
        y = f.read(dtype="float32", always_2d=False).T
        rate, channels = int(f.samplerate), int(f.channels)
    if y.ndim > 1:
        y = np.mean(y, axis=tuple(range(y.ndim - 1)))
    return DecodedAudio(y, rate, channels)


def _decode_pyav(data: bytes, demuxer: str, limits: MediaLimits, stop: threading.Event | None) -> DecodedAudio:
    """vLLM's `load_audio_pyav(sr=None)`: every frame of the first audio stream as it decodes, joined along time,
    as float32, averaged over channels; formats whose raw frames are not float samples per channel are refused.
    `demuxer` is forced (vLLM's loader probes)."""
    container = open_for_decoding(data, demuxer, "audio")
    chunks: list[np.ndarray] = []
    with container:
        if not container.streams.audio:
            raise MediaError(400, "could not decode audio: no audio stream")
        stream = container.streams.audio[0]
        stream.thread_type = "AUTO"
        rate, channels = int(stream.rate or 0), int(stream.codec_context.channels or 0)
        _check_header(rate, channels, limits)
        fmt = stream.codec_context.format
        if fmt is None or fmt.name not in FLOAT_FORMATS or (channels > 1 and not fmt.is_planar):
            raise MediaError(
                400,
                f"unsupported audio encoding ({stream.codec_context.name}, "
                f"{fmt.name if fmt else 'unknown'} samples): vLLM 0.32 does not read it as audio; "
                "send wav, flac, ogg or mp3",
            )
        if stream.duration and stream.time_base:
            _check_length(int(stream.duration * stream.time_base * rate), rate, channels, limits)
        frames = 0
        try:
            for frame in container.decode(stream):
                _check_stop(stop)
                chunks.append(frame.to_ndarray())
                frames += chunks[-1].shape[-1]
                _check_length(frames, rate, channels, limits)
        except av.FFmpegError as exc:
            raise MediaError(400, f"could not decode audio: {exc}") from exc
    if not chunks:
        raise MediaError(400, "could not decode audio: no audio frames")
    audio = np.concatenate(chunks, axis=-1).astype(np.float32)
    if audio.ndim > 1:
        audio = np.mean(audio, axis=0)
    return DecodedAudio(audio, rate, channels)
