"""`--compile inductor` on CUDA: the compiled Qwen towers replay CUDA graphs (one recorded per token count) and give
the eager towers' rows, a forward's output stays the caller's after later forwards reuse the graphs' buffers."""

from __future__ import annotations

import pytest
import torch

from eric_epd.models.registry import load_encoder
from eric_epd.testing.exactness import compiled_as_exact

GRIDS = ([(1, 8, 12)], [(1, 16, 16)], [(1, 16, 16), (1, 8, 12), (2, 12, 8)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_compiled_tower_with_cuda_graphs_equals_eager(
    family: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    checkpoint = request.getfixturevalue(f"{family}_tiny")
    eager = load_encoder(checkpoint, dtype, "cuda:0")
    compiled = load_encoder(checkpoint, dtype, "cuda:0")
    exact = load_encoder(checkpoint, torch.float64, "cuda:0")
    compiled.compile_parts()
    assert compiled.cuda_graphs
    generator = torch.Generator().manual_seed(0)
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for _ in range(3):  # cudagraph trees: a shape's first call warms up, the second records, the third replays
        for grid in GRIDS:
            rows = sum(t * h * w for t, h, w in grid)
            pixels = torch.randn(rows, eager.patch_embed.in_dim, generator=generator).cuda()
            ours, reference, rows64 = compiled(pixels, grid), eager(pixels, grid), exact(pixels.double(), grid)
            assert ours.dtype == dtype and ours.shape == reference.shape
            compiled_as_exact(ours, reference, rows64, f"{family} {dtype} {grid}")
            kept.append((ours, reference, rows64))
    torch.cuda.synchronize()
    for ours, reference, rows64 in kept:  # earlier outputs were not overwritten by the replays after them
        compiled_as_exact(ours, reference, rows64, f"{family} {dtype} kept")
