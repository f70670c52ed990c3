"""Band-limited resampling of decoded audio as vLLM 0.32 resamples it for a model's feature extractor: windowed-sinc
interpolation with a Hann window over 6 zero crossings at 0.99 of the lower Nyquist rate (its default `torchaudio`
method, `torchaudio.transforms.Resample(orig, target)`), computed here in torch, which torchaudio needs anyway."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

ZERO_CROSSINGS = 6
"""Zero crossings of the sinc kept on each side (torchaudio's `lowpass_filter_width` default)."""
ROLLOFF = 0.99
"""The filter's cut-off as a fraction of the lower rate's Nyquist frequency (torchaudio's default)."""
METHOD = f"sinc_interp_hann/{ZERO_CROSSINGS}/{ROLLOFF}"
"""Names the resampler in content hashes."""


@functools.lru_cache(maxsize=32)
def sinc_kernel(orig_sr: int, target_sr: int) -> tuple[torch.Tensor, int]:
    """The polyphase filter bank taking `orig_sr` to `target_sr` (rates already divided by their gcd), as float32
    [target_sr, 1, taps], and the padding (in input samples) it needs on the left. Output phase j of a block reads the
    input around j / target_sr seconds: weights sinc(t) x hann(t) at the input's offsets t from it, in units of the
    lower rate's period scaled by ROLLOFF, cut at ZERO_CROSSINGS; evaluated in float64, then cast."""
    cutoff = min(orig_sr, target_sr) * ROLLOFF
    pad = math.ceil(ZERO_CROSSINGS * orig_sr / cutoff)
    offsets = torch.arange(-pad, pad + orig_sr, dtype=torch.float64)[None, None] / orig_sr
    phases = torch.arange(0, -target_sr, -1)[:, None, None] / target_sr  # float32, as torchaudio's default dtype
    t = ((phases + offsets) * cutoff).clamp_(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=t.dtype), torch.sin(t) / t)
    return (sinc * (window * (cutoff / orig_sr))).to(torch.float32), pad


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Mono float32 `samples` at `orig_sr` Hz as float32 samples at `target_sr` Hz: ceil(n * target / orig) of them,
    each a windowed-sinc weighted sum of the input (zero beyond its ends). The input itself when the rates agree."""
    if orig_sr == target_sr:
        return samples
    gcd = math.gcd(orig_sr, target_sr)
    up, down = target_sr // gcd, orig_sr // gcd
    kernel, pad = sinc_kernel(down, up)
    wave = torch.as_tensor(np.ascontiguousarray(samples, dtype=np.float32)).reshape(1, 1, -1)
    padded = torch.nn.functional.pad(wave, (pad, pad + down))
    with torch.no_grad():
        blocks = torch.nn.functional.conv1d(padded, kernel, stride=down)  # [1, up, blocks]: one phase per channel
    out = blocks.transpose(1, 2).reshape(-1)
    return out[: math.ceil(up * samples.shape[-1] / down)].numpy()
