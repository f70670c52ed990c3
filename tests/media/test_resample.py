"""The resampler (media/resample.py) agrees with one that is not ours, SciPy's polyphase `resample_poly`, on
band-limited clips at common and hostile rates, while a wrong rate or a shifted clip fails the same comparison; its
weights are the nonzero ones of torchaudio's dense polyphase bank (transcribed here as vLLM 0.32 builds it); its
working memory stays bounded whatever the rate pair; rates outside its limits are a 413 naming them."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from eric_epd.media.resample import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, kernel_radius, phase_weights, resample
from eric_epd.media.url_policy import MediaError

PAIRS = [
    (8000, 16000),
    (22050, 16000),
    (44100, 16000),
    (48000, 16000),
    (4001, 16000),
    (44101, 16000),
    (191999, 16000),
    (192000, 16000),
    (1000, 16000),
    (16000, 24000),
    (24000, 16000),
    (16000, 22050),
]
"""(orig, target): the common rates, co-prime ones (whose dense bank was gigabytes), the limits, up and down."""
TONES = (0.02, 0.07, 0.15, 0.25)
"""Tone frequencies as fractions of the lower Nyquist rate: well inside both filters' passbands."""
TOLERANCE = 2e-3
"""Max |ours - SciPy's| away from the ends, on a clip peaking near 0.8: the two filters' passbands (Hann vs Kaiser
window) differ by up to 8.5e-4 on these tones (measured over PAIRS)."""


def _tones(rate: int, top: float, delay: float = 0.0) -> np.ndarray:
    """1.33 s of float32 tones at TONES x `top` Hz, each 0.2 high, the clip delayed by `delay` seconds."""
    t = np.arange(rate + rate // 3) / rate - delay
    return sum(0.2 * np.sin(2 * np.pi * f * top * t + k) for k, f in enumerate(TONES)).astype(np.float32)


def _scipy(x: np.ndarray, orig: int, target: int) -> np.ndarray:
    """SciPy's polyphase resampler (Kaiser-windowed FIR, zero phase) in float64."""
    gcd = math.gcd(orig, target)
    return resample_poly(x.astype(np.float64), target // gcd, orig // gcd)


def _error(ours: np.ndarray, theirs: np.ndarray, target: int) -> float:
    """Max |difference| over the samples both have, 100 ms from either end (the filters differ most at the edges)."""
    n = min(len(ours), len(theirs)) - target // 10
    return float(np.abs(ours[target // 10 : n] - theirs[target // 10 : n]).max())


@pytest.mark.parametrize(("orig", "target"), PAIRS)
def test_resampler_agrees_with_scipys_polyphase_resampler(orig: int, target: int) -> None:
    top = min(orig, target) / 2
    x = _tones(orig, top)
    ours, theirs = resample(x, orig, target), _scipy(x, orig, target)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (math.ceil(len(x) * target / orig),)
    assert _error(ours, theirs, target) <= TOLERANCE
    # negative controls: the clip one period of the lower rate late, and (for 44.1 kHz) declared at 48 kHz
    late = resample(_tones(orig, top, delay=1 / min(orig, target)), orig, target)
    assert _error(late, theirs, target) > 20 * TOLERANCE
    if orig == 44100:
        assert _error(resample(x, 48000, target), theirs, target) > 100 * TOLERANCE


def _torchaudio_bank(down: int, up: int) -> torch.Tensor:
    """torchaudio's `_get_sinc_resample_kernel` for `transforms.Resample(orig, new)` (dtype None, as vLLM 0.32
    calls it), rates already divided by their gcd: float32 [up, down + 2 * width]."""
    base = min(down, up) * 0.99
    width = math.ceil(6 * down / base)
    idx = torch.arange(-width, width + down, dtype=torch.float64)[None] / down
    t = (torch.arange(0, -up, -1)[:, None] / up + idx) * base  # the phases in float32 (torch's default dtype)
    t = t.clamp(-6, 6)
    window = torch.cos(t * math.pi / 6 / 2) ** 2
    t = t * math.pi
    return (torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t) * (window * (base / down))).to(torch.float32)


@pytest.mark.parametrize(("down", "up"), [(441, 160), (3, 1), (2, 3), (320, 441), (401, 1600)])
def test_weights_are_the_nonzero_part_of_torchaudios_bank(down: int, up: int) -> None:
    bank = _torchaudio_bank(down, up).numpy()
    pad = kernel_radius(down, up)
    assert bank.shape == (up, down + 2 * pad)
    ours = phase_weights(np.arange(up), down, up)
    dense = np.zeros((up, down + 2 * pad + 1), dtype=np.float32)  # one column more: our last tap may fall past it
    for p in range(up):
        first = p * down // up  # tap m reads input offset first - pad + m: column first + m of the bank
        dense[p, first : first + 2 * pad + 1] = ours[p]
    assert not dense[:, -1].any()
    np.testing.assert_array_equal(dense[:, :-1], bank)


MEMORY_PROBE = textwrap.dedent("""
    import re, tracemalloc
    import numpy as np
    from eric_epd.media.resample import resample

    def kib(field):  # this process's resident set now (VmRSS) or at its peak (VmHWM)
        with open("/proc/self/status") as status:
            return int(re.search(field + r":\\s+(\\d+) kB", status.read()).group(1))

    clips = [(orig, target, np.random.default_rng(0).standard_normal(2 * orig).astype(np.float32))
             for orig, target in {pairs}]
    resident = kib("VmRSS")
    for orig, target, x in clips:
        tracemalloc.start()
        y = resample(x, orig, target)
        peak = tracemalloc.get_traced_memory()[1] - x.nbytes - y.nbytes  # over the clip and its result
        tracemalloc.stop()
        del y
        print(orig, target, peak)
    print("rss", (kib("VmHWM") - resident) * 1024)  # the peak resident set over the one before resampling
""")


def test_working_memory_is_bounded_whatever_the_rates() -> None:
    """2 s clips at the rates whose dense bank took 2.4, 5.6 and 24.6 GB, and the pairs with the largest weight
    table (2.9M values); measured in a fresh process, by tracemalloc and by the process's peak resident set (which
    sees any library's allocations)."""
    pairs = [(4001, 16000), (44101, 16000), (191999, 16000), (191999, 192000), (192000, 1000), (1000, 191999)]
    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE.format(pairs=pairs)], capture_output=True, text=True, check=True
    )
    *peaks, rss = probe.stdout.split("\n")[:-1]
    for line in peaks:  # measured: 2 to 26 MB (the weight table and one block of taps)
        assert int(line.split()[-1]) < 48 * 2**20, line
    assert int(rss.split()[-1]) < 64 * 2**20, rss  # measured: 25 MB (tracemalloc's own bookkeeping included)


@pytest.mark.parametrize(
    ("orig", "target"),
    [
        (MAX_SAMPLE_RATE + 1, 16000),
        (MIN_SAMPLE_RATE - 1, 16000),
        (0, 16000),
        (16000, MAX_SAMPLE_RATE + 1),
        (16000, 16000 * 10**6),
    ],
)
def test_rates_outside_the_limits_are_a_413_naming_them(orig: int, target: int) -> None:
    with pytest.raises(MediaError) as caught:
        resample(np.zeros(1000, np.float32), orig, target)
    message = caught.value.message
    assert caught.value.status == 413 and f"{orig if orig != 16000 else target} Hz" in message, message
    assert f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz" in message and "MAX_SAMPLE_RATE" in message, message
    for edge in (MIN_SAMPLE_RATE, MAX_SAMPLE_RATE):  # the limits themselves are taken
        assert resample(np.zeros(1000, np.float32), edge, 16000).shape == (math.ceil(1000 * 16000 / edge),)
