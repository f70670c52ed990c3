"""bfloat16 attention through bfloat16 GEMMs on CPUs whose bfloat16 units torch's flash kernel leaves unused
(AVX512-BF16 without AMX): the choice per CPU, its values against float64 attention written here (with a negative
control), its chunking, and that the towers' attention takes it only for bfloat16 on such a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eric_epd.models.layers import attention
from eric_epd.models.layers.attention import bf16_gemm_attention_for, dense_attention, gemm_attention

BOUND = 2e-2
"""Largest |error| of bfloat16 attention on unit-normal inputs against float64 (the scores and probabilities are
rounded to bfloat16, as in transformers' eager attention): measured up to about 8e-3 here."""


def _inputs(dtype: torch.dtype, seed: int = 0, heads: int = 4, length: int = 300, dim: int = 32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, length, dim, generator=g).to(dtype) for _ in range(3)]


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


def test_float32_values_equal_attention() -> None:
    q, k, v = _inputs(torch.float32, seed=2)
    torch.testing.assert_close(gemm_attention(q, k, v).double(), _reference(q, k, v), rtol=0, atol=1e-5)


def test_chunks_of_queries_give_the_whole() -> None:
    q, k, v = _inputs(torch.bfloat16, seed=3)
    whole = gemm_attention(q, k, v)
    rows_of_7 = 7 * 2 * 4 * k.shape[2] * 2  # score bytes of 7 queries: 300 queries in 43 chunks
    torch.testing.assert_close(gemm_attention(q, k, v, chunk_bytes=rows_of_7), whole, rtol=0, atol=1 / 64)
    assert (gemm_attention(q, k, v, chunk_bytes=1) - whole).abs().max() <= 1 / 64  # a query at a time


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
