"""Eric's InternVL tower (InternViT + pixel-shuffle projector) against transformers' get_image_features: the tiny
internvl checkpoint and two variants of it (qk-norm, RMSNorm, attention bias, a final layernorm; features from an
inner layer), TP 1 in process and TP 2 over gloo in spawned processes; its loader; the tower behind the generic
runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eric_epd.models.internvl import InternVLVisionTower, checkpoint_key, feature_depth
from eric_epd.models.layers.parallel import TPContext
from eric_epd.testing.media import random_image

REL_ERR = 1e-5
"""max|ours - ref| / max|ref| in float32: the same sums, only their order may differ (TP's all-reduce)."""
VARIANTS = {
    "qknorm": {
        "vision_config": {
            "use_qk_norm": True,
            "norm_type": "rms_norm",
            "attention_bias": True,
            "use_mean_pooling": False,
        }
    },
    "inner": {"vision_feature_layer": -2, "vision_config": {"use_mean_pooling": False}},
}
"""Variants of the tiny checkpoint's config: every option of InternViT's layers and a final layernorm; features
from the first of two layers (hidden_states[-2]; the checkpoint's second layer and layernorm go unread)."""


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _variant(base: Path, out: Path, change: dict[str, Any]) -> Path:
    """A random checkpoint of the tiny one's config with `change` merged in (one level deep for vision_config)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from eric_epd.checkpoints.saving import jitter_constants

    config = json.loads((base / "config.json").read_text())
    config = {**config, **change, "vision_config": {**config["vision_config"], **change.get("vision_config", {})}}
    torch.manual_seed(1)
    model = InternVLForConditionalGeneration(InternVLConfig.from_dict(config)).to(torch.float32).eval()
    jitter_constants(model, 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dirs(_checkpoint_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from eric_epd.checkpoints.families import ensure_family_checkpoint

    tiny = ensure_family_checkpoint("internvl")
    out = tmp_path_factory.mktemp("internvl-variants")
    return {"tiny": tiny, **{name: _variant(tiny, out / name, change) for name, change in VARIANTS.items()}}


@pytest.fixture(scope="module")
def case(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """Three images of 4, 1 and 7 crops (tiles plus thumbnail) batched as the processor batches them, and
    transformers' rows for them from each checkpoint (the full model in float32)."""
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    images = [random_image(200, 60, seed=1), random_image(70, 64, seed=2), random_image(90, 150, seed=3)]
    inputs = AutoProcessor.from_pretrained(model_dirs["tiny"]).image_processor(images=images, return_tensors="pt")
    assert inputs["num_patches"].tolist() == [4, 1, 7]
    refs = {}
    for name, model_dir in model_dirs.items():
        model = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            refs[name] = model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)
    return {"pixel_values": inputs["pixel_values"], "refs": refs}


@pytest.mark.parametrize("name", ["tiny", *VARIANTS])
def test_tp1_rows_equal_hf(name: str, model_dirs: dict[str, Path], case: dict[str, Any]) -> None:
    tower = InternVLVisionTower.from_checkpoint(model_dirs[name], TPContext(), torch.float32, "cpu")
    rows, ref = tower(case["pixel_values"]), case["refs"][name]
    assert rows.shape == ref.shape == (12 * 4, 64) and rows.dtype == torch.float32
    assert _rel_err(rows, ref) <= REL_ERR
    singles = torch.cat([tower(crop[None]) for crop in case["pixel_values"]])  # batching changes nothing
    assert _rel_err(singles, rows) <= REL_ERR
    assert tower(case["pixel_values"][:0]).shape == (0, 64)
    assert len(tower.encoder.layer) == (1 if name == "inner" else 2)
    assert (tower.layernorm is not None) == (name == "qknorm")


# ---- TP 2 over gloo (the spawning pattern of test_gemma3_tower.py) -----------------------------------------------


def _tp_worker(
    rank: int, world: int, init: str, model_dirs: dict[str, str], pixel_values: torch.Tensor, out_dir: str
) -> None:
    import torch.distributed as dist

    from tests.support.tp_spawn import leave_at_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = {}
        for name, model_dir in model_dirs.items():
            tower = InternVLVisionTower.from_checkpoint(model_dir, TPContext(rank, world), torch.float32, "cpu")
            layer = tower.encoder.layer[0]
            attn, mlp = layer.attention, layer.mlp
            results[name] = {
                "rows": tower(pixel_values),
                "qkv": attn.qkv.weight,
                "qkv_bias": attn.qkv.bias,
                "proj": attn.projection_layer.weight,
                "fc1": mlp.fc1.weight,
                "fc2": mlp.fc2.weight,
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_at_once()  # its results are saved: no teardown in this process (tests/support/tp_spawn.py)


@pytest.fixture(scope="module")
def tp2_results(
    model_dirs: dict[str, Path], case: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, dict[str, Any]]]:
    import torch.multiprocessing as mp

    from tests.support.tp_spawn import rendezvous

    out_dir = tmp_path_factory.mktemp("internvl-tp2")
    dirs = {name: str(path) for name, path in model_dirs.items()}
    mp.spawn(_tp_worker, args=(2, rendezvous(out_dir), dirs, case["pixel_values"], str(out_dir)), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("name", ["tiny", *VARIANTS])
def test_tp2_rows_equal_hf_on_every_rank(
    name: str, case: dict[str, Any], tp2_results: list[dict[str, dict[str, Any]]]
) -> None:
    for result in tp2_results:
        assert result[name]["rows"].shape == case["refs"][name].shape
        assert _rel_err(result[name]["rows"], case["refs"][name]) <= REL_ERR
    assert torch.equal(tp2_results[0][name]["rows"], tp2_results[1][name]["rows"])  # replicated after all-reduces


@pytest.mark.parametrize("name", ["tiny", "qknorm"])
def test_tp2_ranks_hold_their_own_shards(
    name: str, model_dirs: dict[str, Path], tp2_results: list[dict[str, dict[str, Any]]]
) -> None:
    """Each rank holds one of the two heads of q, k and v (and of the q norm), half of projection_layer's inputs,
    half of the MLP."""
    full = load_file(model_dirs[name] / "model.safetensors")
    prefix = next(k for k in full if k.endswith("encoder.layer.0.lambda_1")).removesuffix("lambda_1")
    for rank, tp2 in enumerate(tp2_results):
        result, heads, width = tp2[name], slice(32 * rank, 32 * (rank + 1)), slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(result["qkv"], torch.cat([full[f"{prefix}attention.{p}_proj.weight"][heads] for p in "qkv"]))
        if name == "qknorm":
            bias = torch.cat([full[f"{prefix}attention.{p}_proj.bias"][heads] for p in "qkv"])
            assert torch.equal(result["qkv_bias"], bias)
            assert torch.equal(result["q_norm"], full[f"{prefix}attention.q_norm.weight"][heads])
        else:
            assert result["qkv_bias"] is None and result["q_norm"] is None
        assert torch.equal(result["proj"], full[f"{prefix}attention.projection_layer.weight"][:, heads])
        assert torch.equal(result["fc1"], full[f"{prefix}mlp.fc1.weight"][width])
        assert torch.equal(result["fc2"], full[f"{prefix}mlp.fc2.weight"][:, width])


# ---- loading and refusals ---------------------------------------------------------------------------------------


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in load_file(model_dir / "model.safetensors").items()
        if k.startswith(("vision_tower.", "multi_modal_projector."))
    }


def _empty(model_dir: Path) -> InternVLVisionTower:
    from eric_epd.models.facts import read_config

    return InternVLVisionTower(read_config(model_dir))


def test_both_namings_load_the_same_tower(model_dirs: dict[str, Path]) -> None:
    released = _weights(model_dirs["tiny"])
    ref = InternVLVisionTower.from_checkpoint(model_dirs["tiny"])
    for rename in (lambda k: k, lambda k: "model." + k):  # released -hf checkpoints, transformers 5's save
        tower = _empty(model_dirs["tiny"])
        loaded = tower.load_weights((rename(k), v) for k, v in released.items())
        assert loaded == {checkpoint_key(k) for k in released} == tower.expected_keys()
        for (name, a), (_, b) in zip(tower.named_parameters(), ref.named_parameters(), strict=True):
            assert torch.equal(a, b), name


def test_inner_feature_layer_reads_only_its_layers(model_dirs: dict[str, Path]) -> None:
    weights = _weights(model_dirs["inner"])
    assert any(".layer.1." in k for k in weights) and "vision_tower.layernorm.weight" in weights
    loaded = _empty(model_dirs["inner"]).load_weights(weights.items())
    assert not any(k.startswith(("encoder.layer.1.", "layernorm.")) for k in loaded)
    assert [feature_depth(layer, 2) for layer in (-1, -2, -3, 0, 1, 2)] == [2, 1, 0, 0, 1, 2]


def test_loader_fails_loudly(model_dirs: dict[str, Path]) -> None:
    tiny = model_dirs["tiny"]
    weights = list(_weights(tiny).items())
    v_proj = next(k for k, _ in weights if k.endswith("layer.1.attention.v_proj.weight"))
    with pytest.raises(KeyError, match=r"missing.*layer\.1\.attention\.v_proj\.weight"):
        _empty(tiny).load_weights((k, v) for k, v in weights if k != v_proj)
    with pytest.raises(KeyError, match="unexpected"):
        _empty(tiny).load_weights([*weights, ("vision_tower.encoder.layer.2.lambda_1", torch.zeros(64))])
    with pytest.raises(KeyError, match="given twice"):
        _empty(tiny).load_weights([*weights, weights[0]])
    with pytest.raises(KeyError, match="not an InternVL vision"):
        _empty(tiny).load_weights([("language_model.norm.weight", torch.zeros(64))])
    bad = [(k, torch.zeros(3)) if k.endswith("layer.0.lambda_2") else (k, v) for k, v in weights]
    with pytest.raises(ValueError, match=r"lambda_2: shape mismatch"):
        _empty(tiny).load_weights(bad)


def test_configs_it_refuses(model_dirs: dict[str, Path]) -> None:
    config = json.loads((model_dirs["tiny"] / "config.json").read_text())
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        InternVLVisionTower(config, TPContext(0, 3))
    with pytest.raises(ValueError, match="only 'default'"):
        InternVLVisionTower({**config, "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match="vision_feature_layer"):
        InternVLVisionTower({**config, "vision_feature_layer": [-1, -2]})
    with pytest.raises(ValueError, match="not square"):
        InternVLVisionTower({**config, "vision_config": {**config["vision_config"], "image_size": [64, 32]}})
    with pytest.raises(ValueError, match=r"downsample_ratio 0\.3 does not evenly shrink"):
        InternVLVisionTower({**config, "downsample_ratio": 0.3})
    with pytest.raises(ValueError, match=r"expected \[crops, 3, 64, 64\]"):
        InternVLVisionTower.from_checkpoint(model_dirs["tiny"])(torch.zeros(1, 3, 32, 64))


def test_bfloat16_tower_runs_in_bfloat16(model_dirs: dict[str, Path], case: dict[str, Any]) -> None:
    tower = InternVLVisionTower.from_checkpoint(model_dirs["qknorm"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())
    rows = tower(case["pixel_values"])
    assert rows.dtype == torch.bfloat16 and rows.shape == case["refs"]["qknorm"].shape
    cos = torch.nn.functional.cosine_similarity(rows.float().flatten(), case["refs"]["qknorm"].flatten(), dim=0)
    assert cos > 0.99, cos  # bfloat16 rounds; sanity only


# ---- served: the generic path's processor and runner, Eric's tower ------------------------------------------------


def test_generic_runner_runs_the_tower(model_dirs: dict[str, Path]) -> None:
    """Eric's workload for InternVL (accepted at --tp 2, refused at 3) loads the tower behind the generic runner;
    images of 4, 1 and 7 crops through Eric's processor give transformers' rows for the same pixels (each its own
    kind: the runner runs one forward per crop count), and so does a video's 32 frames (one tile each)."""
    from transformers import InternVLForConditionalGeneration

    from eric_epd.eric.decode import decode_video
    from eric_epd.eric.generic import GenericRunner, GenericWorkload
    from eric_epd.eric.workload import encoder_workload, work_item
    from eric_epd.media.limits import MediaLimits
    from eric_epd.models.facts import ModelFacts
    from eric_epd.models.hf.tensors import unpack_tensors
    from eric_epd.models.internvl import InternVLEncoder
    from eric_epd.models.registry import load_processor
    from eric_epd.runtime.config import RuntimeConfig
    from eric_epd.testing.media import video_bytes

    tiny = model_dirs["tiny"]
    facts = ModelFacts.from_checkpoint(tiny)
    assert isinstance(encoder_workload(RuntimeConfig(model=tiny, tp_size=2), facts), GenericWorkload)
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        encoder_workload(RuntimeConfig(model=tiny, tp_size=3), facts)
    config = RuntimeConfig(model=tiny, dtype="float32", device="cpu")
    workload = encoder_workload(config, facts)
    runner = workload.load(config, torch.device("cpu"), TPContext())
    assert isinstance(runner, GenericRunner) and isinstance(runner.encoder, InternVLEncoder)
    processor = load_processor(tiny)
    images = (random_image(200, 60, seed=1), random_image(70, 64, seed=2), random_image(90, 150, seed=3))
    items = [processor.process_image(image) for image in images]
    work = [work_item(f"item{i}", item, 0, 0) for i, item in enumerate(items)]
    assert all(workload.validate(w, item.pixel_values.nbytes) is None for w, item in zip(work, items))
    rows = runner.run(work, torch.cat([torch.from_numpy(item.pixel_values) for item in items]))
    model = InternVLForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    for item, mine in zip(items, rows, strict=True):
        pixels = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))["pixel_values"]
        with torch.no_grad():
            ref = model.get_image_features(pixels).pooler_output.flatten(0, 1)
        assert mine.shape == ref.shape == (item.num_tokens, 64)
        assert _rel_err(mine, ref) <= REL_ERR
    assert [r.shape[0] for r in rows] == [16, 4, 28]
    video = processor.process_video(
        decode_video(video_bytes(40, 64, 48, fps=8, seed=4), MediaLimits(), processor.frame_indices)[0]
    )
    (mine,) = runner.run([work_item("video", video, 0, 0)], torch.from_numpy(video.pixel_values))
    frames = unpack_tensors(video.tensors, torch.from_numpy(video.pixel_values))["pixel_values"]
    with torch.no_grad():  # a video's frames are tiles of the image path (vLLM's interns1.py, transformers' forward)
        ref = model.get_image_features(frames).pooler_output.flatten(0, 1)
    assert mine.shape == ref.shape == (32 * 4, 64) and _rel_err(mine, ref) <= REL_ERR
