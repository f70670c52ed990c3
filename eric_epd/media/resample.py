"""Band-limited resampling of decoded audio as vLLM 0.32 resamples it for a model's feature extractor: windowed-sinc
interpolation with a Hann window over 6 zero crossings at 0.99 of the lower Nyquist rate (its default `torchaudio`
method, `torchaudio.transforms.Resample(orig, target)`: the kernel evaluated in float64 from float32 phases, then cast
to float32), in numpy.

torchaudio builds a dense polyphase bank of `up` phases by `down + 2 * pad` taps (rates divided by their gcd): for
co-prime rates, e.g. a clip at 44101 Hz going to 16 kHz, that is gigabytes. Here output sample j, at input time
j * down / up, reads only the 2 * pad + 1 inputs around it, the only ones torchaudio's kernel weighs (beyond them its
kernel is the clamped value, 0 in float32):

    input    x[s - pad] ... x[s] ... x[s + pad]        s = floor(j * down / up)
    weights  w[j % up, 0] ...        w[j % up, 2 * pad]   the nonzero ones of torchaudio's phase j % up
    output   y[j] = sum_m w[j % up, m] * x[s - pad + m]   (x is zero beyond its ends)

The weights are computed once per phase in use (min(up, outputs) of them) and applied WORK_ELEMENTS taps at a time,
so work and memory are linear in the clip, with taps per output (about 12 * orig / target when downsampling, 15 when
upsampling) and the weight table (under 3M float32 values, ~12 MB, for any rate pair) bounded by the rate limits."""

from __future__ import annotations

import math

import numpy as np

from eric_epd.media.limits import MAX_AUDIO_SAMPLE_RATE
from eric_epd.media.url_policy import MediaError

ZERO_CROSSINGS = 6
"""Zero crossings of the sinc kept on each side (torchaudio's `lowpass_filter_width` default)."""
ROLLOFF = 0.99
"""The filter's cut-off as a fraction of the lower rate's Nyquist frequency (torchaudio's default)."""
METHOD = f"sinc_interp_hann/{ZERO_CROSSINGS}/{ROLLOFF}"
"""Names the resampler in content hashes."""
MIN_SAMPLE_RATE = 1_000
"""Lowest rate (Hz) resampled, from or to. Below any rate audio is recorded at (telephony's 8 kHz is the lowest in
common use); it caps how many outputs one input sample makes (target / orig <= MAX / MIN = 192)."""
MAX_SAMPLE_RATE = MAX_AUDIO_SAMPLE_RATE
"""Highest rate (Hz) resampled, from or to (192 kHz): --max-audio-sample-rate's default and ceiling, which decoding
checks first. It caps the taps per output sample (about 12 * orig / target) and the weight table (under 3M float32
values)."""
WORK_ELEMENTS = 1 << 18
"""Taps (outputs x taps per output) computed or applied at a time: bounds the temporaries to a few MB."""


def check_rate(rate: int, role: str) -> None:
    """Refuse (413) a rate the resampler does not take, naming its limits; `role` says which rate it is."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise MediaError(
            413,
            f"the audio's {role} sample rate is {rate} Hz, outside the resampler's limits of "
            f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz (MIN_SAMPLE_RATE, MAX_SAMPLE_RATE in "
            "eric_epd/media/resample.py)",
        )


def kernel_radius(down: int, up: int) -> int:
    """torchaudio's `width` for rates already divided by their gcd: the inputs on each side of an output's time that
    may carry weight, ZERO_CROSSINGS periods of the filter's cut-off, in input samples."""
    return math.ceil(ZERO_CROSSINGS * down / (min(down, up) * ROLLOFF))


def phase_weights(phases: np.ndarray, down: int, up: int) -> np.ndarray:
    """float32 [len(phases), 2 * pad + 1]: the weights output phase p (0 <= p < up) puts on inputs
    floor(p * down / up) - pad + m of its block, m = 0 .. 2 * pad, exactly as torchaudio's kernel computes them: the
    phase -p / up in float32 (torchaudio's arange / int), the offset in float64, sinc x Hann at their sum in units of
    the cut-off's period, cast to float32. Taps beyond ZERO_CROSSINGS get the clamped value, 0 in float32."""
    pad = kernel_radius(down, up)
    cutoff = min(down, up) * ROLLOFF
    taps = np.arange(-pad, pad + 1, dtype=np.int64)
    out = np.empty((len(phases), len(taps)), dtype=np.float32)
    rows = max(1, WORK_ELEMENTS // len(taps))
    for lo in range(0, len(phases), rows):
        p = phases[lo : lo + rows].astype(np.int64)
        phase = (np.float32(-1) * p.astype(np.float32)) / np.float32(up)  # -p / up rounded to float32
        offsets = ((p * down) // up)[:, None] + taps[None, :]  # input index - block start, as torchaudio's idx
        t = (phase.astype(np.float64)[:, None] + offsets / down) * cutoff
        np.clip(t, -ZERO_CROSSINGS, ZERO_CROSSINGS, out=t)
        window = np.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
        t *= math.pi
        sinc = np.ones_like(t)
        np.divide(np.sin(t), t, out=sinc, where=t != 0)
        out[lo : lo + rows] = sinc * (window * (cutoff / down))
    return out


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Mono float32 `samples` at `orig_sr` Hz as float32 samples at `target_sr` Hz: ceil(n * target / orig) of them,
    each a windowed-sinc weighted sum of the input (zero beyond its ends). The input itself when the rates agree.
    Either rate outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] is refused with a MediaError (413)."""
    check_rate(orig_sr, "source")
    check_rate(target_sr, "target")
    if orig_sr == target_sr:
        return samples
    gcd = math.gcd(orig_sr, target_sr)
    up, down = target_sr // gcd, orig_sr // gcd
    x = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
    n_out = math.ceil(up * x.shape[0] / down)
    out = np.empty(n_out, dtype=np.float32)
    if n_out == 0:
        return out
    pad = kernel_radius(down, up)
    weights = phase_weights(np.arange(min(up, n_out)), down, up)
    padded = np.concatenate([np.zeros(pad, np.float32), x, np.zeros(pad + 1, np.float32)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * pad + 1)  # windows[s]: inputs s - pad .. s + pad
    block = max(1, WORK_ELEMENTS // (2 * pad + 1))
    for lo in range(0, n_out, block):
        j = np.arange(lo, min(lo + block, n_out), dtype=np.int64)
        taps = windows[(j * down) // up]
        out[lo : lo + len(j)] = np.einsum("ij,ij->i", weights[j % up], taps)
    return out
