"""bfloat16 attention through bfloat16 GEMMs on CPUs whose bfloat16 units torch's flash kernel leaves unused
(AVX512-BF16 without AMX): the choice per CPU, its values against float64 attention written here (with negative
controls: shuffled values, and sharp attention's scores rounded to bfloat16 before the softmax), its chunking, and
that the towers' attention takes it only for bfloat16 on such a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eric_epd.models.layers import attention
from eric_epd.models.layers.attention import bf16_gemm_attention_for, dense_attention, gemm_attention

BOUND = 2e-2
"""Largest |error| of bfloat16 attention on unit-normal inputs against float64 (the probabilities and the output are
rounded to bfloat16): measured up to 2.6e-3 here (torch's flash kernel: 1.8e-3; scores rounded to bfloat16 before the
softmax, as transformers' eager attention does: 8e-3)."""
SHARP, SHARP_BOUND = 3.0, 5e-2
"""q and k scaled by SHARP (logits up to about 40, as trained towers' sharp heads have): measured up to 2.3e-2 here
(torch's flash kernel: 1.5e-2; scores rounded to bfloat16 first: 0.17 to 0.27)."""


def _inputs(
    dtype: torch.dtype, seed: int = 0, heads: int = 4, length: int = 300, dim: int = 32, sharp: float = 1.0
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, length, dim, generator=g) for _ in range(3))
    return [(q * sharp).to(dtype), (k * sharp).to(dtype), v.to(dtype)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention in float64: softmax(q k^T / sqrt(d)) v."""
    q, k, v = (t.double() for t in (q, k, v))
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return weights @ v


@pytest.mark.parametrize(
    ("units", "chosen"),
    [
        (frozenset({"avx512_bf16"}), True),
        (frozenset({"avx512_bf16", "amx_bf16"}), False),
        (frozenset({"amx_bf16"}), False),
        (frozenset(), False),
        (frozenset({"avx512_fp16"}), False),
    ],
)
def test_the_choice_per_cpu(units: frozenset[str], chosen: bool) -> None:
    assert bf16_gemm_attention_for(units) is chosen


def test_bfloat16_values_are_attentions_within_the_bound() -> None:
    q, k, v = _inputs(torch.bfloat16)
    ours, reference = gemm_attention(q, k, v), _reference(q, k, v)
    assert ours.dtype is torch.bfloat16 and ours.shape == q.shape
    error = (ours.double() - reference).abs().max().item()
    assert error <= BOUND, error
    # negative control: the same attention over values whose rows are shuffled is far outside the bound
    wrong = gemm_attention(q, k, v[:, :, torch.randperm(v.shape[2], generator=torch.Generator().manual_seed(1))])
    assert (wrong.double() - reference).abs().max().item() > 10 * BOUND


def test_sharp_attention_keeps_its_scores_precision() -> None:
    q, k, v = _inputs(torch.bfloat16, seed=5, sharp=SHARP)
    reference = _reference(q, k, v)
    error = (gemm_attention(q, k, v).double() - reference).abs().max().item()
    assert error <= SHARP_BOUND, error
    # negative control: the scores rounded to bfloat16 before the softmax (transformers' eager attention, written here)
    rounded = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v
    assert (rounded.double() - reference).abs().max().item() > 2 * SHARP_BOUND


def test_float32_values_equal_attention() -> None:
    q, k, v = _inputs(torch.float32, seed=2)
    torch.testing.assert_close(gemm_attention(q, k, v).double(), _reference(q, k, v), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 3 * 300], ids=["a-query", "7-queries", "3-heads"])
def test_chunks_of_rows_give_the_whole(rows: int) -> None:
    q, k, v = _inputs(torch.bfloat16, seed=3)
    whole = gemm_attention(q, k, v)  # 8 heads of 300 queries in one chunk
    chunked = gemm_attention(q, k, v, chunk_bytes=rows * k.shape[2] * 2)  # `rows` (head, query) rows of scores
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1 / 64)


@pytest.mark.parametrize("gemms", [False, True], ids=["flash", "gemms"])
def test_towers_attention_takes_the_gemms_only_for_bfloat16_where_chosen(
    monkeypatch: pytest.MonkeyPatch, gemms: bool
) -> None:
    monkeypatch.setattr(attention, "_bf16_gemm_attention", lambda: gemms)
    q, k, v = _inputs(torch.bfloat16, seed=4)
    expected = gemm_attention(q, k, v) if gemms else F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(dense_attention(q, k, v), expected)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert torch.equal(dense_attention(q32, k32, v32), F.scaled_dot_product_attention(q32, k32, v32))
