"""Eric's vision encoders (TP 1 in-process, TP 2 over gloo in spawned processes) against transformers'
get_image_features / get_video_features on tiny offline checkpoints of both families."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.qwen2_vl import Qwen2VLVisionEncoder
from eric_epd.models.registry import (
    build_encoder,
    get_model_spec,
    load_encoder,
    load_processor,
    read_model_config,
    resolve_dtype,
)
from tests.support.tp_spawn import rendezvous

logger = logging.getLogger(__name__)

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# float32 equality with transformers. The sums are the same; only their order differs (batched SDPA vs HF's
# per-image calls, TP all-reduce of partial matmuls), so differences are ~1e-6 on outputs of magnitude ~5.
RTOL, ATOL = 1e-4, 1e-5
IMAGE_SIZES = [(56, 84), (112, 112), (200, 150), (224, 224), (97, 131), (60, 300)]  # (width, height)
VIDEO_SHAPES = [(6, 84, 112), (5, 56, 84)]  # (frames, height, width); 5 frames exercises temporal padding


def _media() -> tuple[list[Image.Image], list[np.ndarray]]:
    rng = np.random.default_rng(1234)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in IMAGE_SIZES]
    videos = [rng.integers(0, 256, (*shape, 3), dtype=np.uint8) for shape in VIDEO_SHAPES]
    return images, videos


def _pack(items: list) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    return np.concatenate([it.float_pixels() for it in items]), [it.grid_thw for it in items]


@pytest.fixture(scope="module")
def checkpoints(qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> dict[str, Path]:
    """The session's tiny checkpoints (conftest: built offline into a per-session cache; never modified here)."""
    return {"qwen2_vl": qwen2_vl_tiny, "qwen2_5_vl": qwen2_5_vl_tiny}


@pytest.fixture(scope="module")
def cases(checkpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Per family: our processed batches, HF's processor outputs, and HF's features per item."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    images, videos = _media()
    out: dict[str, dict[str, Any]] = {}
    for family, ckpt in checkpoints.items():
        hf_proc = AutoProcessor.from_pretrained(ckpt)
        hf_img = hf_proc.image_processor(images=images, return_tensors="pt")
        hf_vid = hf_proc.video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
        model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        with torch.no_grad():
            img_feats = model.model.get_image_features(hf_img["pixel_values"], hf_img["image_grid_thw"])
            vid_feats = model.model.get_video_features(hf_vid["pixel_values_videos"], hf_vid["video_grid_thw"])
        ours = load_processor(ckpt)
        out[family] = {
            "ckpt": ckpt,
            "images": _pack([ours.process_image(im) for im in images]),
            "videos": _pack([ours.process_video(v) for v in videos]),
            "hf_images": (hf_img["pixel_values"].numpy(), hf_img["image_grid_thw"].tolist()),
            "hf_videos": (hf_vid["pixel_values_videos"].numpy(), hf_vid["video_grid_thw"].tolist()),
            "ref_images": list(img_feats.pooler_output),
            "ref_videos": list(vid_feats.pooler_output),
        }
    return out


def _assert_matches_hf(ours: torch.Tensor, refs: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> None:
    sizes = [t * h * w // 4 for t, h, w in grids]
    assert ours.shape == (sum(sizes), refs[0].shape[-1])
    for i, (mine, ref) in enumerate(zip(torch.split(ours.float(), sizes), refs, strict=True)):
        assert mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"item {i}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_output_equals_hf(cases: dict, family: str) -> None:
    case = cases[family]
    for ours_key, hf_key in (("images", "hf_images"), ("videos", "hf_videos")):
        (pv, grids), (hf_pv, hf_grids) = case[ours_key], case[hf_key]
        assert [list(g) for g in grids] == hf_grids
        assert pv.dtype == np.float32
        np.testing.assert_array_equal(pv, hf_pv)  # bit-exact


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_equals_hf(cases: dict, family: str) -> None:
    case = cases[family]
    enc = load_encoder(case["ckpt"], torch.float32, torch.device("cpu"), TPContext())
    for key in ("images", "videos"):
        pv, grids = case[key]
        out = enc(torch.from_numpy(pv), torch.tensor(grids))  # all images (or all videos) in one forward
        _assert_matches_hf(out, case["ref_" + key], grids)


# ---- TP 2 over gloo --------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, init: str, jobs: dict[str, dict[str, Any]], out_dir: str) -> None:
    import torch.distributed as dist

    from tests.support.tp_spawn import leave_at_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tp = TPContext(rank, world)
        for family, job in jobs.items():
            results: dict[str, torch.Tensor] = {}
            for dtype in (torch.float32, torch.bfloat16):
                enc = load_encoder(Path(job["ckpt"]), dtype, torch.device("cpu"), tp)
                for key in ("images", "videos"):
                    pv, grids = job[key]
                    results[f"{key}-{dtype}"] = enc(torch.from_numpy(pv), torch.tensor(grids))
            torch.save(results, Path(out_dir) / f"{family}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_at_once()  # its results are saved: no teardown in this process (tests/support/tp_spawn.py)


@pytest.fixture(scope="module")
def tp2_results(cases: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, torch.Tensor]]]:
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("tp2")
    jobs = {f: {"ckpt": str(c["ckpt"]), "images": c["images"], "videos": c["videos"]} for f, c in cases.items()}
    mp.spawn(_tp_worker, args=(2, rendezvous(out_dir), jobs, str(out_dir)), nprocs=2, join=True)
    return {f: [torch.load(out_dir / f"{f}-rank{r}.pt", weights_only=True) for r in range(2)] for f in cases}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_equals_hf(cases: dict, tp2_results: dict, family: str) -> None:
    case, ranks = cases[family], tp2_results[family]
    for key in ("images", "videos"):
        grids = case[key][1]
        for rank_out in ranks:  # every rank holds the full, identical result
            _assert_matches_hf(rank_out[f"{key}-{torch.float32}"], case["ref_" + key], grids)
        torch.testing.assert_close(
            ranks[0][f"{key}-{torch.float32}"], ranks[1][f"{key}-{torch.float32}"], rtol=0, atol=0
        )
        bf16 = ranks[0][f"{key}-{torch.bfloat16}"]
        assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16.float()).all()
        assert bf16.shape == ranks[0][f"{key}-{torch.float32}"].shape


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_equals_hf_tightly(cases: dict, family: str) -> None:
    """In float64 the remaining differences vanish: same math, not just close numbers. (Both apply the
    rotary embedding in float32, as HF does, so agreement is bounded by float32 rounding of q/k there.)"""
    from transformers import AutoModelForImageTextToText

    case = cases[family]
    model = AutoModelForImageTextToText.from_pretrained(case["ckpt"], dtype=torch.float64).eval()
    enc = load_encoder(case["ckpt"], torch.float64, torch.device("cpu"))
    pv, grids = case["images"]
    with torch.no_grad():
        ref = model.model.get_image_features(torch.from_numpy(pv).double(), torch.tensor(grids)).pooler_output
    out = enc(torch.from_numpy(pv).double(), torch.tensor(grids))
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_runs(cases: dict, family: str) -> None:
    case = cases[family]
    enc = load_encoder(case["ckpt"], torch.bfloat16, torch.device("cpu"), TPContext())
    assert all(p.dtype == torch.bfloat16 for p in enc.parameters())
    pv, grids = case["images"]
    out = enc(torch.from_numpy(pv), torch.tensor(grids))
    ref = torch.cat(case["ref_images"])
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out.float()).all()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    assert cos > 0.99, cos  # sanity only: bf16 is not expected to equal float32


# ---- loading --------------------------------------------------------------------------------


def test_load_weights_fails_loudly(checkpoints: dict[str, Path]) -> None:
    ckpt = checkpoints["qwen2_vl"]
    from eric_epd.models.registry import iter_vision_tensors

    weights = list(iter_vision_tensors(ckpt, get_model_spec("qwen2_vl").weight_prefixes))
    enc = build_encoder(ckpt, torch.float32, "cpu")
    with pytest.raises(KeyError, match="missing"):
        enc.load_weights(weights[:-1])
    enc = build_encoder(ckpt, torch.float32, "cpu")
    with pytest.raises(KeyError, match="unexpected"):
        enc.load_weights([*weights, ("visual.blocks.9.attn.qkv.weight", weights[0][1])])
    enc = build_encoder(ckpt, torch.float32, "cpu")
    bad = [(n, torch.zeros(3, 3)) if n.endswith("norm1.weight") else (n, t) for n, t in weights]
    with pytest.raises(ValueError, match="shape mismatch"):
        enc.load_weights(bad)
    enc = build_encoder(ckpt, torch.float32, "cpu")
    loaded = enc.load_weights((n.replace("visual.", "model.visual.", 1), t) for n, t in weights)
    assert loaded == {n for n, _ in enc.named_parameters()}


def test_sharded_checkpoint_never_reads_language_model(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Split the checkpoint into a vision shard and an unreadable LM shard behind an index: must load."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["qwen2_5_vl"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(src / "model.safetensors")
    vision = {k: v for k, v in tensors.items() if k.startswith("visual.")}
    save_file(vision, dst / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    (dst / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")
    weight_map = {
        k: ("model-00001-of-00002.safetensors" if k in vision else "model-00002-of-00002.safetensors") for k in tensors
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    enc = load_encoder(dst, torch.float32, torch.device("cpu"))
    ref = load_encoder(src, torch.float32, torch.device("cpu"))
    for (n, a), (_, b) in zip(enc.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_registry_and_dtypes(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'llava'"):
        get_model_spec("llava")
    assert get_model_spec("qwen2_5_vl").encoder_cls.__name__ == "Qwen2_5_VLVisionEncoder"
    cfg = read_model_config(checkpoints["qwen2_vl"])
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {}) == torch.float32
    assert resolve_dtype("float16", cfg) == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int8", cfg)


def test_encoder_accepts_hf_config_object(checkpoints: dict[str, Path]) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoints["qwen2_vl"])
    enc = Qwen2VLVisionEncoder(cfg.vision_config, TPContext(), torch.float32)
    assert enc.width == cfg.vision_config.embed_dim and enc.out_dim == cfg.vision_config.hidden_size
    assert enc.num_tokens([(1, 8, 12), (3, 4, 4)]) == [24, 12]


def test_varlen_attention_equals_per_segment_attention() -> None:
    """Segments of unique lengths (attended as views), repeated lengths (gathered into one batched call) and empty
    ones, against plain attention over each segment alone."""
    import itertools

    import torch.nn.functional as F

    from eric_epd.models.layers.attention import VarlenPlan, varlen_attention

    lengths = [5, 9, 5, 0, 12, 9, 5, 3]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cu[-1], 4, 16, generator=gen) for _ in range(3))
    plan = VarlenPlan.build(cu, torch.device("cpu"))
    assert sorted(length for length, _ in plan.groups) == [5, 9] and sorted(plan.slices) == [(19, 12), (45, 3)]
    out = varlen_attention(q, k, v, plan, scale=0.25)
    for a, b in itertools.pairwise(cu):
        if b > a:
            ref = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=0.25)
            torch.testing.assert_close(out[a:b], ref.transpose(0, 1), rtol=1e-5, atol=1e-6)
