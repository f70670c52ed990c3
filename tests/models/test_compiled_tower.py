"""`--compile inductor`: the compiled Qwen towers against the same towers run eagerly (in process, two image sizes
alone and batched), no graph built after the load-time compile, a served compiled Eric (TP 2) answering as an eager
one (TP 1) does, and the refusals."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import load as load_safetensors
from torch._dynamo.utils import counters

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.eric.config import EricConfig
from eric_epd.eric.workload import encoder_workload
from eric_epd.models.facts import ModelFacts
from eric_epd.models.registry import load_encoder
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.stack.servers import EricServer
from eric_epd.testing.exactness import COMPILED_OVER_EAGER, compiled_as_exact
from eric_epd.testing.media import data_url, image_bytes, random_image
from eric_epd.wire.handles import LEASE_HEADER

GRIDS = ([(1, 8, 12)], [(1, 16, 16)], [(1, 16, 16), (1, 8, 12), (2, 12, 8)])
"""Two image sizes alone, then batched with a two-frame video: token counts 96, 256 and 544."""


def _pixels(encoder: torch.nn.Module, grid: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, encoder.patch_embed.in_dim, generator=torch.Generator().manual_seed(seed))


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("qwen2_vl", torch.float32),
        ("qwen2_5_vl", torch.float32),
        ("qwen2_5_vl", torch.bfloat16),
        ("qwen3_vl", torch.float32),
    ],
)
def test_compiled_tower_equals_eager(family: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    """Each block's compiled parts and the mergers give rows as near the float64 tower's as the eager tower's, for
    every token count, and the load-time compile built every graph: later batches of other sizes build none.
    Negative control: the compiled rows with noise at ten times the eager rows' own error fail the same check."""
    checkpoint = request.getfixturevalue(f"{family}_tiny")
    eager, exact = load_encoder(checkpoint, dtype, "cpu"), load_encoder(checkpoint, torch.float64, "cpu")
    compiled = load_encoder(checkpoint, dtype, "cpu")
    torch._dynamo.reset()  # the towers compiled before in this process share its recompile limit
    before = _graphs()
    compiled.compile_parts()
    mergers = 1 + len(compiled.tap_layers)
    assert _graphs() - before == 2 * compiled.depth + mergers  # one graph per compiled part, at load
    built = _graphs()
    for seed, grid in enumerate(GRIDS):
        pixels = _pixels(eager, grid, seed)
        ours, reference, rows64 = compiled(pixels, grid), eager(pixels, grid), exact(pixels.double(), grid)
        assert ours.dtype == dtype and ours.shape == reference.shape == (sum(eager.num_tokens(grid)), ours.shape[1])
        _, own = compiled_as_exact(ours, reference, rows64, f"{family} {dtype} {grid}")
        _control(ours, reference, rows64, own)
    assert _graphs() == built


def _control(ours: torch.Tensor, reference: torch.Tensor, rows64: torch.Tensor, own: float) -> None:
    """Noise of ten times the eager rows' error (relative to the largest row value) fails compiled_as_exact."""
    scale = 10 * COMPILED_OVER_EAGER * own * rows64.abs().max().item()
    noisy = ours.double() + scale * torch.randn(
        ours.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    with pytest.raises(AssertionError, match="from float64"):
        compiled_as_exact(noisy, reference, rows64, "noisy")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_tower_bound_holds_on_the_benchmarks_checkpoint(dtype: torch.dtype) -> None:
    """The same rule on the checkpoint benchmarks/encoder_compile.py measures (`small`: 8 blocks of width 512, where a
    fixed bound set on the tiny towers failed), for one 224 px image."""
    checkpoint = ensure_checkpoint("qwen2_5_vl", "small")
    eager, exact = load_encoder(checkpoint, dtype, "cpu"), load_encoder(checkpoint, torch.float64, "cpu")
    compiled = load_encoder(checkpoint, dtype, "cpu")
    torch._dynamo.reset()  # the towers compiled before in this process share its recompile limit
    before = _graphs()
    compiled.compile_parts()
    assert _graphs() - before == 2 * compiled.depth + 1 + len(compiled.tap_layers)  # compiled, not run eagerly
    grid = [(1, 16, 16)]
    pixels = _pixels(eager, grid, 7)
    ours, reference, rows64 = compiled(pixels, grid), eager(pixels, grid), exact(pixels.double(), grid)
    _, own = compiled_as_exact(ours, reference, rows64, f"small {dtype}")
    _control(ours, reference, rows64, own)


def test_compile_is_refused_where_it_does_not_apply(tmp_path: Path) -> None:
    """The generic path runs transformers' classes eagerly: --compile stops the start and says so; an unknown mode
    is refused by the config."""
    generic = tmp_path / "generic"
    generic.mkdir()
    (generic / "config.json").write_text('{"model_type": "llava_onevision", "vision_config": {}}')
    with pytest.raises(ValueError, match="--compile inductor compiles the Qwen families' towers; llava_onevision"):
        encoder_workload(RuntimeConfig(model=generic), ModelFacts.from_checkpoint(generic), "inductor")
    with pytest.raises(ValueError, match="compile must be one of"):
        EricConfig(model=generic, compile="tensorrt")


def _embeddings(eric: EricServer, urls: list[str]) -> list[torch.Tensor]:
    resp = httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=120,
        json={"items": [{"modality": "image", "url": url} for url in urls]},
    )
    assert resp.status_code == 200, resp.text
    out = []
    for item in resp.json()["items"]:
        fetched = httpx.get(
            item["handle"]["http"], timeout=60, headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]}
        )
        assert fetched.status_code == 200, fetched.text
        out.append(load_safetensors(fetched.content)["embedding"])
    return out


def test_served_compiled_eric_answers_as_an_eager_one(qwen2_5_vl_tiny: Path, tmp_path: Path) -> None:
    """`eric-epd serve --compile inductor` at TP 2 (its row-parallel all-reduces inside the compiled graphs) gives
    the embeddings an eager TP-1 Eric gives, for two image sizes in one request."""
    images = [random_image(120, 90, seed=3), random_image(200, 150, seed=4)]
    urls = [data_url(image_bytes(image)) for image in images]
    with EricServer(
        qwen2_5_vl_tiny,
        tp=2,
        extra_args=("--compile", "inductor", "--dtype", "float32"),
        log_path=tmp_path / "compiled.log",
    ) as eric:
        card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
        assert card["tp_size"] == 2
        compiled = _embeddings(eric, urls)
    with EricServer(qwen2_5_vl_tiny, extra_args=("--dtype", "float32"), log_path=tmp_path / "eager.log") as eric:
        eager = _embeddings(eric, urls)
    assert [e.shape for e in compiled] == [e.shape for e in eager] and compiled[0].shape != compiled[1].shape
    for ours, reference, rows64 in zip(compiled, eager, _float64_rows(qwen2_5_vl_tiny, images), strict=True):
        compiled_as_exact(ours, reference, rows64, "served at TP 2")
    assert "compiled the vision tower" in (tmp_path / "compiled.log").read_text()


def _float64_rows(checkpoint: Path, images: list[Image.Image]) -> list[torch.Tensor]:
    """Each image's rows from the tower in float64 in this process, its pixels from transformers' processor."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint)
    tower = load_encoder(checkpoint, torch.float64, "cpu")
    out = []
    for image in images:
        inputs = processor(images=[image], return_tensors="pt")
        grid = [tuple(int(v) for v in g) for g in inputs["image_grid_thw"]]
        out.append(tower(inputs["pixel_values"].double(), grid))
    return out
