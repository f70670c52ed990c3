"""Variable-length attention over packed sequences (flash-attn or torch's varlen kernel on CUDA, length-grouped
attention otherwise: `dense_attention`) and the 2-D vision rotary embedding of Qwen2-VL / Qwen2.5-VL, applied in
float32 as HF does."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@functools.cache
def flash_varlen() -> Callable | None:
    """flash-attn's varlen kernel (the optional `flash` extra), preferred on CUDA when installed; None otherwise.
    Looked up on first use: importing it (or torch's) costs seconds that a CPU process never needs."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


@functools.cache
def torch_varlen() -> Callable | None:
    """torch's own varlen flash kernel (CUDA, fp16/bf16), used when flash-attn is not installed; None before torch
    2.9. Its module imports torch._dynamo (about 2 s), hence the lookup on first use."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # torch older than 2.9
        return None
    return varlen_attn


def cuda_varlen_kernel() -> str:
    """Which varlen kernel a CUDA fp16/bf16 forward uses: "flash_attn", "torch", or "sdpa" (length-grouped SDPA)."""
    return "flash_attn" if flash_varlen() is not None else "torch" if torch_varlen() is not None else "sdpa"


GEMM_CHUNK_BYTES = 4 << 20
"""The most bytes of attention scores `gemm_attention` holds at once (it takes (head, query) rows in chunks under it):
on an AMD EPYC with 1 MiB of L2 a core, 2-8 MiB ran a 4,000-patch image 8% faster than 16 MiB and 44% faster than 64."""


def bf16_gemm_attention_for(units: frozenset[str]) -> bool:
    """Whether bfloat16 attention on a CPU with `units` (compute_dtype.UNITS' names) goes through bfloat16 GEMMs:
    with AVX512-BF16 and no AMX-BF16, torch's CPU flash kernel computes bfloat16 at about float32's speed (measured
    on an AMD EPYC), while torch's bfloat16 GEMMs run at 4x float32's; with AMX the flash kernel is kept."""
    return "avx512_bf16" in units and "amx_bf16" not in units


@functools.cache
def _bf16_gemm_attention() -> bool:
    """bf16_gemm_attention_for on this process's CPU, asked (and logged) once."""
    from eric_epd.models.compute_dtype import cpu_units

    chosen = bf16_gemm_attention_for(cpu_units())
    if chosen:
        logger.info("bfloat16 attention on this CPU goes through bfloat16 GEMMs: it has AVX512-BF16 and no AMX-BF16")
    return chosen


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Non-causal attention of (..., heads, L, d) q, k, v: torch's SDPA, or `gemm_attention` for bfloat16 on a CPU
    where that is faster (bf16_gemm_attention_for)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and _bf16_gemm_attention():
        return gemm_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def gemm_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, chunk_bytes: int = GEMM_CHUNK_BYTES
) -> torch.Tensor:
    """Non-causal attention of (..., heads, L, d) q, k, v as GEMMs in their dtype around a softmax (which torch
    computes in float32 and rounds to that dtype), a chunk of (head, query) rows at a time so that at most
    `chunk_bytes` of scores exist at once. A chunk's scores are computed twice: first for each query's largest score
    m, then as scale * q k^T - m in one GEMM (baddbmm subtracts before it rounds to q's dtype). The scores near m,
    which carry the softmax's weight, so keep float32's precision, as in torch's flash kernel; scores rounded to
    bfloat16 first (transformers' eager attention) are off by |score| * 2^-9, a few percent of a weight once a
    tower's attention is sharp."""
    *lead, length, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    queries = q.reshape(-1, length, head_dim).contiguous()
    keys = k.reshape(-1, k.shape[-2], head_dim).contiguous().transpose(1, 2)  # (B, d, Lk): a view, no copy
    values = v.reshape(-1, v.shape[-2], v.shape[-1]).contiguous()
    out = torch.empty(queries.shape[0], length, values.shape[-1], dtype=q.dtype, device=q.device)
    budget = max(1, chunk_bytes // max(1, keys.shape[-1] * q.element_size()))  # rows of scores per chunk
    heads, rows = max(1, budget // max(1, length)), max(1, min(length, budget))
    for head in range(0, queries.shape[0], heads):
        kc, vc = keys[head : head + heads], values[head : head + heads]
        for start in range(0, length, rows):
            qc = queries[head : head + heads, start : start + rows]
            shift = torch.matmul(qc, kc).amax(dim=-1, keepdim=True).mul_(-scale)
            scores = torch.baddbmm(shift, qc, kc, alpha=scale)
            torch.matmul(torch.softmax(scores, dim=-1), vc, out=out[head : head + heads, start : start + rows])
    return out.reshape(*lead, length, values.shape[-1])


@dataclass(frozen=True)
class VarlenPlan:
    """How to run attention over one packing of segments; built once per forward and shared by all layers.

    `groups` holds, per distinct segment length L, the token indices (n, L) of the n segments of that length,
    or None when a single group covers the whole packed sequence in order (then a plain view suffices).
    `slices` holds (start, length) of segments whose length no other segment shares: those are contiguous, so
    they are attended as views, with no gather or scatter.
    """

    cu_seqlens: torch.Tensor  # (num_segments + 1,) int32 on the compute device
    max_seqlen: int
    total: int
    groups: tuple[tuple[int, torch.Tensor | None], ...]
    slices: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(cls, cu_seqlens: Sequence[int] | torch.Tensor, device: torch.device) -> VarlenPlan:
        """The plan for segments bounded by `cu_seqlens`: equal lengths gathered in groups, unique ones as slices."""
        cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if not cu or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
        starts_by_len: dict[int, list[int]] = {}
        for a, b in itertools.pairwise(cu):
            if b > a:
                starts_by_len.setdefault(b - a, []).append(a)
        total = cu[-1]
        groups: list[tuple[int, torch.Tensor | None]] = []
        slices: list[tuple[int, int]] = []
        if len(starts_by_len) == 1:
            (length,) = starts_by_len
            groups.append((length, None))
        else:
            for length, starts in sorted(starts_by_len.items()):
                if len(starts) == 1:
                    slices.append((starts[0], length))
                    continue
                idx = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(length)[None, :]
                groups.append((length, idx.to(device)))
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        return cls(cu_t, max(starts_by_len, default=0), total, tuple(groups), tuple(slices))


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, scale: float | None = None
) -> torch.Tensor:
    """Non-causal attention within each packed segment; q, k, v and the result are (N, heads, head_dim)."""
    n_tok, heads, head_dim = q.shape
    if n_tok != plan.total:
        raise ValueError(f"attention got {n_tok} tokens but the plan covers {plan.total}")
    if n_tok == 0:
        return torch.empty_like(q)
    kernel = cuda_varlen_kernel() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "sdpa"
    if kernel == "torch":
        return torch_varlen()(q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen, scale=scale)
    if kernel == "flash_attn":
        return flash_varlen()(
            q,
            k,
            v,
            plan.cu_seqlens,
            plan.cu_seqlens,
            plan.max_seqlen,
            plan.max_seqlen,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=False,
        )
    if plan.groups and plan.groups[0][1] is None:  # one group covering everything: (n, L, H, d) is a view
        length = plan.groups[0][0]
        qs, ks, vs = (t.view(-1, length, heads, head_dim) for t in (q, k, v))
        return _sdpa(qs, ks, vs, scale).reshape(n_tok, heads, head_dim)
    out = torch.empty_like(q)
    for start, length in plan.slices:
        end = start + length
        out[start:end] = _sdpa(q[None, start:end], k[None, start:end], v[None, start:end], scale)[0]
    for _, idx in plan.groups:
        assert idx is not None
        res = _sdpa(q[idx], k[idx], v[idx], scale)
        out[idx.reshape(-1)] = res.reshape(-1, heads, head_dim)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(n, L, H, d) in and out."""
    return dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)


def vision_rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (N, head_dim) in float32 for (N, 2) (row, col) position ids, laid out like HF:
    [h-freqs, w-freqs, h-freqs, w-freqs], each head_dim/4 wide."""
    spatial_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float, device=device) / spatial_dim))
    freqs = position_ids.to(device)[..., None].float() * inv_freq  # (N, 2, head_dim/4)
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_vision_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q, k (N, heads, head_dim) in float32 with (N, head_dim) cos/sin; cast back to their dtype."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    qf, kf = q.float(), k.float()
    q_out = qf * cos + _rotate_half(qf) * sin
    k_out = kf * cos + _rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
