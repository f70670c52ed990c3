"""Qwen2.5-Omni's thinker on Eric's generic path, on the tiny offline checkpoint loaded as a real one is: the worker
runs Eric's own towers (models/qwen2_5_omni.py: the chunked audio tower and the Qwen2.5-VL vision tower), built from
and reading only the thinker's tower tensors, and its rows for audio clips (odd lengths and rates, one past the
extractor's 300 s), images and a video equal transformers' full thinker's `get_audio_features`, `get_image_features`
and `get_video_features` on its processor's output, alone and batched, at TP 1 in process and TP 2 over gloo in
spawned processes (each rank holding its shard); transformers' classes (HFOmniEncoder) give them too; an audio item
holds exactly the processor's log-mel frames that its mask keeps."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.media.resample import resample
from eric_epd.models.facts import ModelFacts, serves_tp
from eric_epd.models.hf.loader import vision_tensor_names
from eric_epd.models.hf.omni import HFOmniEncoder, HFOmniProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.qwen2_5_omni import UNUSED_KEYS, Qwen2_5OmniTowerEncoder, checkpoint_key
from eric_epd.models.registry import load_processor, vision_weights_digest
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.testing.media import audio_samples, random_image, video_frames
from tests.support.generic_batches import (
    assert_alone_and_batched,
    generic_runner,
    joined_job,
    relative_error,
    run_batch,
    tower_tp2,
)
from tests.support.omni_reference import AUDIO_TEXT, omni_rows

Served = tuple[GenericWorkload, GenericRunner]
Refs = dict[str, list[torch.Tensor]]

RTOL = 1e-5
"""Worst relative error (max |ours - transformers'| / max |transformers'|) in float32: the same modules on the same
inputs; a batch changes only the rounding of batched matmuls."""
BF16_RTOL = 3e-2
"""bfloat16 against float32: bfloat16 roundings (2^-8 each) through two layers and the projection."""

CLIPS = ((3 * 16000 + 7, 16000), (12345, 16000), (17641, 44100), (301 * 8000 + 5, 8000))
"""(samples, rate): odd lengths, a 44.1 kHz clip (resampled first), and one past the extractor's 300 s."""
IMAGES = ((200, 150), (64, 64), (333, 97))
"""(width, height) of the images."""


def _waves() -> list[tuple[np.ndarray, int]]:
    return [(audio_samples(n, rate, seed=i)[:, 0], rate) for i, (n, rate) in enumerate(CLIPS)]


def _images() -> list:
    return [random_image(w, h, seed=10 + i) for i, (w, h) in enumerate(IMAGES)]


def _video() -> np.ndarray:
    return video_frames(6, 120, 90, seed=2)


@pytest.fixture(scope="module")
def processor(qwen2_5_omni_tiny: Path) -> HFOmniProcessor:
    processor = load_processor(qwen2_5_omni_tiny)
    assert isinstance(processor, HFOmniProcessor) and processor.modalities == ("image", "video", "audio")
    return processor


@pytest.fixture(scope="module")
def references(qwen2_5_omni_tiny: Path) -> Refs:
    return omni_rows(qwen2_5_omni_tiny, _waves(), _images(), [_video()])


@pytest.fixture(scope="module")
def served(qwen2_5_omni_tiny: Path) -> Served:
    workload, runner = generic_runner(qwen2_5_omni_tiny)
    assert isinstance(runner.encoder, Qwen2_5OmniTowerEncoder)  # Eric's own towers, at TP 1 too
    return workload, runner


def test_audio_rows_equal_transformers_alone_and_batched(
    processor: HFOmniProcessor, served: Served, references: Refs
) -> None:
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    assert [it.num_tokens for it in items] == [75, 19, 10, 7500]  # the last cut at 300 s, as the extractor cuts it
    kinds = {work_item("k", it, 0, 0).kind for it in items}
    assert kinds == {"audio/input_features:128,audio_feature_lengths:"}  # clips of any length join one forward
    assert_alone_and_batched(*served, items, references["audio"], RTOL)


def test_audio_items_hold_the_processors_valid_log_mels(qwen2_5_omni_tiny: Path, processor: HFOmniProcessor) -> None:
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(qwen2_5_omni_tiny)
    for wave, rate in _waves()[:3]:
        item = processor.process_audio(wave, rate)
        ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        theirs = hf(text=[AUDIO_TEXT], audio=[resample(wave, rate, 16000)], return_tensors="pt")
        mask = theirs["feature_attention_mask"].bool()
        assert theirs["input_features"].shape == (1, 128, 30000)  # padded to 300 s
        torch.testing.assert_close(
            ours["input_features"], theirs["input_features"].permute(0, 2, 1)[mask], rtol=0, atol=0
        )
        assert ours["audio_feature_lengths"].tolist() == mask.sum(-1).tolist()
        assert item.cost < 200  # the frames it holds, not 300 s of padding


def test_image_rows_equal_transformers_alone_and_batched(
    processor: HFOmniProcessor, served: Served, references: Refs
) -> None:
    items = [processor.process_image(image) for image in _images()]
    assert_alone_and_batched(*served, items, references["image"], RTOL)


def test_video_rows_equal_transformers(processor: HFOmniProcessor, served: Served, references: Refs) -> None:
    # the frames vLLM's loader for Qwen2VLVideoProcessor takes: 2 a second, 4 to 768, an even count
    assert processor.frame_indices(8, 4.0) == [0, 2, 4, 6] and len(processor.frame_indices(301, 30.0)) == 20
    item = processor.process_video(_video())
    assert item.modality == "video" and item.num_tokens == 420
    assert_alone_and_batched(*served, [item], references["video"], RTOL)


def test_bfloat16_rows(qwen2_5_omni_tiny: Path, processor: HFOmniProcessor, references: Refs) -> None:
    workload, runner = generic_runner(qwen2_5_omni_tiny, "bfloat16")
    audio = [processor.process_audio(wave, rate) for wave, rate in _waves()[:2]]
    for ours, ref in zip(run_batch(workload, runner, audio), references["audio"]):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert relative_error(ours, ref) <= BF16_RTOL
    (ours,) = run_batch(workload, runner, [processor.process_image(_images()[0])])
    assert ours.dtype == torch.bfloat16 and relative_error(ours, references["image"][0]) <= BF16_RTOL


def test_transformers_classes_give_the_same_rows(
    qwen2_5_omni_tiny: Path, processor: HFOmniProcessor, served: Served, references: Refs
) -> None:
    """The generic path's transformers encoder (HFOmniEncoder), kept for Omni families without towers of Eric's own,
    on the same batches."""
    workload, _ = served
    runner = GenericRunner(HFOmniEncoder.load(qwen2_5_omni_tiny, torch.float32, "cpu"))
    batches = {
        "audio": [processor.process_audio(wave, rate) for wave, rate in _waves()[:3]],
        "image": [processor.process_image(image) for image in _images()],
        "video": [processor.process_video(_video())],
    }
    for modality, items in batches.items():
        for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items), references[modality])):
            assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, (modality, i)


def test_only_the_thinkers_towers_are_built_read_and_hashed(
    qwen2_5_omni_tiny: Path, served: Served, tmp_path: Path
) -> None:
    _, runner = served
    tower = runner.encoder.tower  # type: ignore[attr-defined]
    assert {name.split(".")[0] for name, _ in tower.named_parameters()} == {"audio_tower", "visual"}
    ckpt = tmp_path / "qwen2_5_omni"
    shutil.copytree(qwen2_5_omni_tiny, ckpt)
    names = vision_tensor_names(ckpt)["model.safetensors"]
    tensors = load_file(ckpt / "model.safetensors")
    towers = {n for n in tensors if n.startswith(("thinker.audio_tower.", "thinker.visual."))}  # the released names
    assert set(names) == towers and len(tensors) > len(towers)  # everything else is the language model's
    assert {checkpoint_key(n) for n in towers} - UNUSED_KEYS == tower.expected_keys()  # what the towers read, all
    base = vision_weights_digest(ckpt)
    language = next(n for n in tensors if n not in towers)
    tensors[language] = tensors[language] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) == base
    for part in ("audio_tower.layers.1", "visual.blocks.1"):  # each tower's tensors are hashed
        tower_tensor = next(n for n in towers if part in n)
        tensors[tower_tensor] = tensors[tower_tensor] + 1
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        assert vision_weights_digest(ckpt) != base
        base = vision_weights_digest(ckpt)


def test_loader_refusals(qwen2_5_omni_tiny: Path, served: Served) -> None:
    from eric_epd.models.qwen2_5_omni import Qwen2_5OmniTowers

    released = {
        n: t
        for n, t in load_file(qwen2_5_omni_tiny / "model.safetensors").items()
        if n.startswith(("thinker.audio_tower.", "thinker.visual."))
    }
    config = ModelFacts.from_checkpoint(qwen2_5_omni_tiny).config
    with pytest.raises(KeyError, match="k_proj has no bias"):
        k_bias = "thinker.audio_tower.layers.0.self_attn.k_proj.bias"
        Qwen2_5OmniTowers(config).load_weights([*released.items(), (k_bias, torch.zeros(64))])
    with pytest.raises(KeyError, match=r"missing.*visual\.blocks\.1\.attn\.k_proj\.bias"):
        k_bias = "thinker.visual.blocks.1.attn.k.bias"  # the vision tower's k has one
        Qwen2_5OmniTowers(config).load_weights((n, t) for n, t in released.items() if n != k_bias)
    with pytest.raises(KeyError, match=r"not a Qwen2\.5-Omni audio or vision tower"):
        Qwen2_5OmniTowers(config).load_weights([("thinker.model.norm.weight", torch.zeros(64))])
    encoder = served[1].encoder
    batch = {"input_features": torch.zeros(101, 128), "audio_feature_lengths": torch.tensor([101])}
    with pytest.raises(RuntimeError, match=r"give \[25\] rows, their specs say \[24\]"):
        encoder.encode(batch, [24], "audio")
    with pytest.raises(RuntimeError, match=r"needs \['video_grid_thw'\]"):
        encoder.encode({"pixel_values_videos": torch.zeros(16, 1176)}, [4], "video")


def test_tensor_parallel_is_served_where_the_towers_split(qwen2_5_omni_tiny: Path) -> None:
    """--tp 2 splits the tiny towers' 2 heads each, the audio FFN and vision MLP of 128; --tp 3 is refused before any
    process starts."""
    facts = ModelFacts.from_checkpoint(qwen2_5_omni_tiny)
    assert facts.generic and facts.modalities == ("image", "video", "audio") and facts.embedding_width == 64
    assert serves_tp("qwen2_5_omni", 2)
    config = RuntimeConfig(model=qwen2_5_omni_tiny, device="cpu", tp_size=2)
    assert isinstance(encoder_workload(config, facts), GenericWorkload)
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        encoder_workload(RuntimeConfig(model=qwen2_5_omni_tiny, device="cpu", tp_size=3), facts)


# ---- TP 2 over gloo (generic_batches.tower_tp2) ---------------------------------------------------------------


SHARDS = {
    "audio_qkv": "audio_tower.layers.0.self_attn.qkv.weight",
    "audio_fc2": "audio_tower.layers.0.fc2.weight",
    "vision_qkv": "visual.blocks.0.attn.qkv.weight",
    "vision_qkv_bias": "visual.blocks.0.attn.qkv.bias",
    "vision_up": "visual.blocks.0.mlp.up_proj.weight",
}
"""The tower parameters each rank hands back (its shard of each)."""


@pytest.fixture(scope="module")
def tp2_results(
    qwen2_5_omni_tiny: Path, processor: HFOmniProcessor, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    items = {
        "audio": [processor.process_audio(wave, rate) for wave, rate in _waves()],
        "image": [processor.process_image(image) for image in _images()],
        "video": [processor.process_video(_video())],
    }
    jobs = {modality: joined_job(modality, its) for modality, its in items.items()}
    return tower_tp2(
        Qwen2_5OmniTowerEncoder, qwen2_5_omni_tiny, jobs, SHARDS, tmp_path_factory.mktemp("qwen2-5-omni-tp2")
    )


def test_tp2_rows_equal_transformers_on_every_rank(references: Refs, tp2_results: list[dict]) -> None:
    """Audio clips of four lengths in one batch, three images in one batch, a video: every rank's rows."""
    for result in tp2_results:
        for modality in ("audio", "image", "video"):
            for i, (ours, ref) in enumerate(zip(result[modality], references[modality], strict=True)):
                assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, (modality, i)
    for modality in ("audio", "image", "video"):
        for a, b in zip(tp2_results[0][modality], tp2_results[1][modality]):
            assert torch.equal(a, b)  # replicated after the all-reduces


def test_tp2_ranks_hold_their_own_shards(qwen2_5_omni_tiny: Path, tp2_results: list[dict]) -> None:
    """Each rank holds one of the two heads of each tower's q, k and v (the vision tower's from its separate q, k
    and v tensors, biases included), half of the audio FFN and of the vision MLP."""
    full = load_file(qwen2_5_omni_tiny / "model.safetensors")
    audio, vision = "thinker.audio_tower.layers.0", "thinker.visual.blocks.0"
    for rank, result in enumerate(tp2_results):
        heads, half = slice(32 * rank, 32 * (rank + 1)), slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(
            result["audio_qkv"], torch.cat([full[f"{audio}.self_attn.{p}_proj.weight"][heads] for p in "qkv"])
        )
        assert torch.equal(result["audio_fc2"], full[f"{audio}.fc2.weight"][:, half])
        assert torch.equal(result["vision_qkv"], torch.cat([full[f"{vision}.attn.{p}.weight"][heads] for p in "qkv"]))
        bias = torch.cat([full[f"{vision}.attn.{p}.bias"][heads] for p in "qkv"])
        assert torch.equal(result["vision_qkv_bias"], bias)
        assert torch.equal(result["vision_up"], full[f"{vision}.mlp.up_proj.weight"][half])
