"""Qwen2.5-Omni's thinker on Eric's generic path, on the tiny offline checkpoint loaded as a real one is: the worker
builds and reads only the thinker's audio tower and vision tower, and its rows for audio clips (odd lengths and rates,
one past the extractor's 300 s), images and a video equal transformers' full thinker's `get_audio_features`,
`get_image_features` and `get_video_features` on its processor's output, alone and batched; an audio item holds
exactly the processor's log-mel frames that its mask keeps; TP 1 only."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.eric.generic import TP_REFUSED, GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.media.resample import resample
from eric_epd.models.facts import ModelFacts, serves_tp
from eric_epd.models.hf.loader import vision_tensor_names
from eric_epd.models.hf.omni import HFOmniProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.registry import load_processor, vision_weights_digest
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.testing.media import audio_samples, random_image, video_frames
from tests.support.generic_batches import generic_runner, run_batch
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


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


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
    return generic_runner(qwen2_5_omni_tiny)


def _check(workload: GenericWorkload, runner: GenericRunner, items: list, refs: list[torch.Tensor]) -> None:
    """Each item's rows alone, then all of them in one batch, equal the references."""
    assert [it.num_tokens for it in items] == [r.shape[0] for r in refs]
    for item, ref in zip(items, refs):
        (alone,) = run_batch(workload, runner, [item])
        assert alone.shape == ref.shape and alone.dtype == torch.float32
        assert _relative_error(alone, ref) <= RTOL
    for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items), refs)):
        assert ours.shape == ref.shape, i
        assert _relative_error(ours, ref) <= RTOL, i


def test_audio_rows_equal_transformers_alone_and_batched(processor: HFOmniProcessor, served: Served,
                                                        references: Refs) -> None:
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    assert [it.num_tokens for it in items] == [75, 19, 10, 7500]  # the last cut at 300 s, as the extractor cuts it
    kinds = {work_item("k", it, 0, 0).kind for it in items}
    assert kinds == {"audio/input_features:128,audio_feature_lengths:"}  # clips of any length join one forward
    _check(*served, items, references["audio"])


def test_audio_items_hold_the_processors_valid_log_mels(qwen2_5_omni_tiny: Path, processor: HFOmniProcessor) -> None:
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(qwen2_5_omni_tiny)
    for wave, rate in _waves()[:3]:
        item = processor.process_audio(wave, rate)
        ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        theirs = hf(text=[AUDIO_TEXT], audio=[resample(wave, rate, 16000)], return_tensors="pt")
        mask = theirs["feature_attention_mask"].bool()
        assert theirs["input_features"].shape == (1, 128, 30000)  # padded to 300 s
        torch.testing.assert_close(ours["input_features"], theirs["input_features"].permute(0, 2, 1)[mask],
                                   rtol=0, atol=0)
        assert ours["audio_feature_lengths"].tolist() == mask.sum(-1).tolist()
        assert item.cost < 200  # the frames it holds, not 300 s of padding


def test_image_rows_equal_transformers_alone_and_batched(processor: HFOmniProcessor, served: Served,
                                                        references: Refs) -> None:
    items = [processor.process_image(image) for image in _images()]
    _check(*served, items, references["image"])


def test_video_rows_equal_transformers(processor: HFOmniProcessor, served: Served, references: Refs) -> None:
    # the frames vLLM's loader for Qwen2VLVideoProcessor takes: 2 a second, 4 to 768, an even count
    assert processor.frame_indices(8, 4.0) == [0, 2, 4, 6] and len(processor.frame_indices(301, 30.0)) == 20
    item = processor.process_video(_video())
    assert item.modality == "video" and item.num_tokens == 420
    _check(*served, [item], references["video"])


def test_bfloat16_rows(qwen2_5_omni_tiny: Path, processor: HFOmniProcessor, references: Refs) -> None:
    workload, runner = generic_runner(qwen2_5_omni_tiny, "bfloat16")
    audio = [processor.process_audio(wave, rate) for wave, rate in _waves()[:2]]
    for ours, ref in zip(run_batch(workload, runner, audio), references["audio"]):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert _relative_error(ours, ref) <= BF16_RTOL
    (ours,) = run_batch(workload, runner, [processor.process_image(_images()[0])])
    assert ours.dtype == torch.bfloat16 and _relative_error(ours, references["image"][0]) <= BF16_RTOL


def test_only_the_thinkers_towers_are_built_read_and_hashed(qwen2_5_omni_tiny: Path, served: Served,
                                                            tmp_path: Path) -> None:
    _, runner = served
    built = {name.split(".")[0] for name, _ in runner.encoder.model.named_parameters()}  # type: ignore[attr-defined]
    assert built == {"audio_tower", "visual"}
    ckpt = tmp_path / "qwen2_5_omni"
    shutil.copytree(qwen2_5_omni_tiny, ckpt)
    names = vision_tensor_names(ckpt)["model.safetensors"]
    tensors = load_file(ckpt / "model.safetensors")
    towers = {n for n in tensors if n.startswith(("thinker.audio_tower.", "thinker.visual."))}  # the released names
    assert set(names) == towers and len(tensors) > len(towers)  # everything else is the language model's
    base = vision_weights_digest(ckpt)
    language = next(n for n in tensors if n not in towers)
    tensors[language] = tensors[language] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) == base
    for part in ("audio_tower.layers.1", "visual.blocks.1"):  # each tower's tensors are hashed
        tower = next(n for n in towers if part in n)
        tensors[tower] = tensors[tower] + 1
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        assert vision_weights_digest(ckpt) != base
        base = vision_weights_digest(ckpt)


def test_facts_and_tensor_parallel_refused(qwen2_5_omni_tiny: Path) -> None:
    facts = ModelFacts.from_checkpoint(qwen2_5_omni_tiny)
    assert facts.generic and facts.modalities == ("image", "video", "audio") and facts.embedding_width == 64
    assert not serves_tp("qwen2_5_omni", 2)
    config = RuntimeConfig(model=qwen2_5_omni_tiny, device="cpu", tp_size=2)
    with pytest.raises(ValueError) as caught:
        encoder_workload(config, facts)
    assert str(caught.value) == TP_REFUSED.format(tp=2, model_type="qwen2_5_omni")
