"""Eric's hand-written Gemma 3 vision tower (SigLIP + projector) against transformers' get_image_features on the tiny
gemma3 checkpoint: TP 1 in process, TP 2 over gloo in spawned processes, its loader's name variants and refusals,
and the tower behind the generic path's runner (Eric's processor's items in, transformers' rows out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eric_epd.models.gemma3 import Gemma3VisionTower, checkpoint_key
from eric_epd.models.layers.parallel import TPContext
from eric_epd.testing.media import random_image

REL_ERR = 1e-5
"""max|ours - ref| / max|ref| in float32: the same sums, only their order may differ (TP's all-reduce)."""


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def gemma3_dir(_checkpoint_cache: Path) -> Path:
    from eric_epd.checkpoints.families import ensure_family_checkpoint

    return ensure_family_checkpoint("gemma3")


@pytest.fixture(scope="module")
def hf_model(gemma3_dir: Path) -> torch.nn.Module:
    """transformers' full model in float32."""
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def case(gemma3_dir: Path, hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Crops of two images (a wide one pan-and-scanned into the whole plus 3 crops, a square one whole) and
    transformers' rows for them (the full model in float32)."""
    from transformers import AutoProcessor

    images = [random_image(200, 60, seed=31), random_image(70, 64, seed=32)]
    inputs = AutoProcessor.from_pretrained(gemma3_dir).image_processor(images=images, return_tensors="pt")
    assert inputs["num_crops"].tolist() == [3, 0]  # 5 crops in all
    with torch.no_grad():
        ref = hf_model.get_image_features(inputs["pixel_values"]).pooler_output.flatten(0, 1)
    return {"pixel_values": inputs["pixel_values"], "ref": ref}


def test_tp1_rows_equal_hf(gemma3_dir: Path, case: dict[str, torch.Tensor]) -> None:
    tower = Gemma3VisionTower.from_checkpoint(gemma3_dir, TPContext(), torch.float32, "cpu")
    rows = tower(case["pixel_values"])
    assert rows.shape == case["ref"].shape == (5 * 4, 64) and rows.dtype == torch.float32
    assert _rel_err(rows, case["ref"]) <= REL_ERR
    singles = torch.cat([tower(crop[None]) for crop in case["pixel_values"]])  # batching changes nothing
    assert _rel_err(singles, rows) <= REL_ERR
    assert tower(case["pixel_values"][:0]).shape == (0, 64)


# ---- TP 2 over gloo (the spawning pattern of test_models.py) -------------------------------------------------


def _tp_worker(rank: int, world: int, init: str, model_dir: str, pixel_values: torch.Tensor, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.support.tp_spawn import leave_at_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tower = Gemma3VisionTower.from_checkpoint(model_dir, TPContext(rank, world), torch.float32, "cpu")
        attn, mlp = tower.encoder.layers[0].self_attn, tower.encoder.layers[0].mlp
        torch.save(
            {
                "rows": tower(pixel_values),
                "qkv": attn.qkv.weight,
                "qkv_bias": attn.qkv.bias,
                "out_proj": attn.out_proj.weight,
                "fc1": mlp.fc1.weight,
                "fc2": mlp.fc2.weight,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
    leave_at_once()  # its results are saved: no teardown in this process (tests/support/tp_spawn.py)


@pytest.fixture(scope="module")
def tp2_results(
    gemma3_dir: Path, case: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, torch.Tensor]]:
    import torch.multiprocessing as mp

    from tests.support.tp_spawn import rendezvous

    out_dir = tmp_path_factory.mktemp("gemma3-tp2")
    args = (2, rendezvous(out_dir), str(gemma3_dir), case["pixel_values"], str(out_dir))
    mp.spawn(_tp_worker, args=args, nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_tp2_rows_equal_hf_on_every_rank(case: dict[str, torch.Tensor], tp2_results: list[dict[str, Any]]) -> None:
    for result in tp2_results:
        assert result["rows"].shape == case["ref"].shape
        assert _rel_err(result["rows"], case["ref"]) <= REL_ERR
    assert torch.equal(tp2_results[0]["rows"], tp2_results[1]["rows"])  # replicated after the all-reduces


def test_tp2_ranks_hold_their_own_shards(gemma3_dir: Path, tp2_results: list[dict[str, Any]]) -> None:
    """Each rank holds one of the two heads of q, k and v, half of out_proj's inputs, half of the MLP."""
    full = load_file(gemma3_dir / "model.safetensors")
    attn, mlp = "vision_tower.vision_model.encoder.layers.0.self_attn", "vision_tower.vision_model.encoder.layers.0.mlp"
    for rank, result in enumerate(tp2_results):
        heads = slice(32 * rank, 32 * (rank + 1))  # 2 heads of 32
        qkv = torch.cat([full[f"{attn}.{p}_proj.weight"][heads] for p in "qkv"])
        assert torch.equal(result["qkv"], qkv)
        assert torch.equal(result["qkv_bias"], torch.cat([full[f"{attn}.{p}_proj.bias"][heads] for p in "qkv"]))
        assert torch.equal(result["out_proj"], full[f"{attn}.out_proj.weight"][:, heads])
        assert torch.equal(result["fc1"], full[f"{mlp}.fc1.weight"][64 * rank : 64 * (rank + 1)])
        assert torch.equal(result["fc2"], full[f"{mlp}.fc2.weight"][:, 64 * rank : 64 * (rank + 1)])


# ---- loading ----------------------------------------------------------------------------------------------------


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's vision and projector tensors under their released names."""
    return {
        k: v
        for k, v in load_file(model_dir / "model.safetensors").items()
        if k.startswith(("vision_tower.", "multi_modal_projector."))
    }


def _empty(model_dir: Path) -> Gemma3VisionTower:
    from eric_epd.models.facts import read_config

    return Gemma3VisionTower(read_config(model_dir))


def test_every_checkpoint_naming_loads_the_same_tower(gemma3_dir: Path) -> None:
    released = _weights(gemma3_dir)
    ref = Gemma3VisionTower.from_checkpoint(gemma3_dir)
    namings = [
        lambda k: "model." + k.replace("vision_tower.vision_model.", "vision_tower."),  # transformers 5's save
        lambda k: "model." + k,
        lambda k: k.replace("vision_tower.vision_model.", "vision_tower."),
    ]
    for rename in namings:
        tower = _empty(gemma3_dir)
        loaded = tower.load_weights((rename(k), v) for k, v in released.items())
        assert loaded == {checkpoint_key(k) for k in released} == tower.expected_keys()
        for (name, a), (_, b) in zip(tower.named_parameters(), ref.named_parameters(), strict=True):
            assert torch.equal(a, b), name


def test_loader_fails_loudly(gemma3_dir: Path) -> None:
    weights = list(_weights(gemma3_dir).items())
    k_proj = next(k for k, _ in weights if k.endswith("layers.1.self_attn.k_proj.bias"))
    with pytest.raises(KeyError, match=r"missing.*layers\.1\.self_attn\.k_proj\.bias"):
        _empty(gemma3_dir).load_weights((k, v) for k, v in weights if k != k_proj)
    with pytest.raises(KeyError, match="unexpected"):
        _empty(gemma3_dir).load_weights([*weights, ("vision_tower.vision_model.head.probe", torch.zeros(1, 1, 64))])
    with pytest.raises(KeyError, match="given twice"):
        _empty(gemma3_dir).load_weights([*weights, weights[0]])
    with pytest.raises(KeyError, match="not a Gemma 3 vision"):
        _empty(gemma3_dir).load_weights([("language_model.model.norm.weight", torch.zeros(64))])
    bad = [(k, torch.zeros(3)) if k.endswith("post_layernorm.weight") else (k, v) for k, v in weights]
    with pytest.raises(ValueError, match=r"post_layernorm\.weight: shape mismatch"):
        _empty(gemma3_dir).load_weights(bad)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 3"):
        Gemma3VisionTower({"vision_config": {"hidden_size": 64, "num_attention_heads": 2}}, TPContext(0, 3))


def test_forward_refuses_crops_of_another_size(gemma3_dir: Path) -> None:
    tower = Gemma3VisionTower.from_checkpoint(gemma3_dir)
    with pytest.raises(ValueError, match=r"expected \[crops, 3, 64, 64\]"):
        tower(torch.zeros(1, 3, 32, 64))


def test_bfloat16_tower_runs_in_bfloat16(gemma3_dir: Path, case: dict[str, torch.Tensor]) -> None:
    tower = Gemma3VisionTower.from_checkpoint(gemma3_dir, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())
    rows = tower(case["pixel_values"])
    assert rows.dtype == torch.bfloat16 and rows.shape == case["ref"].shape
    cos = torch.nn.functional.cosine_similarity(rows.float().flatten(), case["ref"].flatten(), dim=0)
    assert cos > 0.99, cos  # bfloat16 rounds; sanity only


# ---- served: the generic path's processor and runner, Eric's tower ------------------------------------------------


def test_generic_runner_runs_the_tower(gemma3_dir: Path, hf_model: torch.nn.Module) -> None:
    """Eric's workload for Gemma 3 (accepted at --tp 2, unlike the other generic families) loads the tower behind
    the generic runner; three images through Eric's processor (one crop each: the processor's call leaves
    pan-and-scan off), joined in one forward, give transformers' rows for the same pixels."""
    from eric_epd.eric.generic import GenericRunner, GenericWorkload
    from eric_epd.eric.workload import encoder_workload, work_item
    from eric_epd.models.facts import ModelFacts
    from eric_epd.models.gemma3 import Gemma3Encoder
    from eric_epd.models.hf.tensors import unpack_tensors
    from eric_epd.models.registry import load_processor
    from eric_epd.runtime.config import RuntimeConfig

    facts = ModelFacts.from_checkpoint(gemma3_dir)
    assert isinstance(encoder_workload(RuntimeConfig(model=gemma3_dir, tp_size=2), facts), GenericWorkload)
    config = RuntimeConfig(model=gemma3_dir, dtype="float32", device="cpu")
    workload = encoder_workload(config, facts)
    runner = workload.load(config, torch.device("cpu"), TPContext())
    assert isinstance(runner, GenericRunner) and isinstance(runner.encoder, Gemma3Encoder)
    processor = load_processor(gemma3_dir)
    images = (random_image(200, 60, seed=31), random_image(70, 64, seed=32), random_image(90, 150, seed=33))
    items = [processor.process_image(image) for image in images]
    work = [work_item(f"item{i}", item, 0, 0) for i, item in enumerate(items)]
    assert all(workload.validate(w, item.pixel_values.nbytes) is None for w, item in zip(work, items))
    rows = runner.run(work, torch.cat([torch.from_numpy(item.pixel_values) for item in items]))
    for item, mine in zip(items, rows):
        pixels = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))["pixel_values"]
        with torch.no_grad():
            ref = hf_model.get_image_features(pixels).pooler_output.flatten(0, 1)
        assert mine.shape == ref.shape == (item.num_tokens, 64)
        assert _rel_err(mine, ref) <= REL_ERR


def test_encoder_and_workload_refusals(gemma3_dir: Path) -> None:
    from eric_epd.eric.workload import encoder_workload
    from eric_epd.models.facts import ModelFacts
    from eric_epd.models.gemma3 import Gemma3Encoder
    from eric_epd.runtime.config import RuntimeConfig

    encoder = Gemma3Encoder.load(gemma3_dir, torch.float32, "cpu")
    crops = {"pixel_values": torch.zeros(2, 3, 64, 64)}
    assert [r.shape for r in encoder.encode(crops, [4, 4])] == [(4, 64), (4, 64)]
    with pytest.raises(RuntimeError, match="images, not video"):
        encoder.encode(crops, [8], "video")
    with pytest.raises(RuntimeError, match="needs pixel_values"):
        encoder.encode({"num_crops": torch.zeros(2)}, [8])
    with pytest.raises(RuntimeError, match=r"gave 8 rows for items of \[4\] rows"):
        encoder.encode(crops, [4])
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        encoder_workload(RuntimeConfig(model=gemma3_dir, tp_size=3), ModelFacts.from_checkpoint(gemma3_dir))
