"""Qwen2-Audio on Eric's generic path, on the tiny offline checkpoint loaded as a real one is: the worker builds and
reads only the audio tower and the projector, and its rows for an audio item equal transformers'
Qwen2AudioForConditionalGeneration's audio features (what its forward scatters into the audio tokens' embeddings)
for several odd lengths and rates, alone and batched, in float32 and bfloat16; the language model's tensors are
outside the digest; TP 1 only."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.eric.generic import TP_REFUSED, GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.models.facts import ModelFacts, serves_tp
from eric_epd.models.hf.audio import HFAudioProcessor
from eric_epd.models.hf.audio_encoder import whisper_frames_needed
from eric_epd.models.hf.loader import vision_tensor_names
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.registry import load_processor, vision_weights_digest
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem
from eric_epd.testing.media import audio_samples
from tests.support.audio_reference import transformers_audio_rows

RTOL = 1e-5
"""Worst relative error (max |ours - transformers'| / max |transformers'|) in float32: the same modules on the same
features; a batch changes only the rounding of batched matmuls."""
BF16_RTOL = 3e-2
"""bfloat16 against float32: bfloat16 roundings (2^-8 each) through two layers and the projector."""

CLIPS = ((3 * 16000 + 7, 16000), (12345, 16000), (17641, 44100), (31 * 16000, 16000))
"""(samples, rate): odd lengths, a 44.1 kHz clip (resampled first), and one past the extractor's 30 s."""


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def _waves() -> list[tuple[np.ndarray, int]]:
    return [(audio_samples(n, rate, seed=i)[:, 0], rate) for i, (n, rate) in enumerate(CLIPS)]


@pytest.fixture(scope="module")
def processor(qwen2_audio_tiny: Path) -> HFAudioProcessor:
    processor = load_processor(qwen2_audio_tiny)
    assert isinstance(processor, HFAudioProcessor) and processor.modalities == ("audio",)
    return processor


@pytest.fixture(scope="module")
def references(qwen2_audio_tiny: Path, processor: HFAudioProcessor) -> list[torch.Tensor]:
    """Per clip, the rows transformers' full model puts at the audio tokens (its processor's features in, the
    language model's input embeddings caught at those positions)."""
    return transformers_audio_rows(qwen2_audio_tiny, _waves())


def _runner(ckpt: Path, dtype: str = "float32") -> tuple[GenericWorkload, GenericRunner]:
    config = RuntimeConfig(model=ckpt, dtype=dtype, device="cpu")
    workload = encoder_workload(config, ModelFacts.from_checkpoint(ckpt))
    assert isinstance(workload, GenericWorkload)
    return workload, workload.load(config, torch.device("cpu"), TPContext())


def _run(workload: GenericWorkload, runner: GenericRunner, items: list) -> list[torch.Tensor]:
    """A batch as the engine hands it to a worker: validated work items, their frames concatenated (float32)."""
    work: list[WorkItem] = [work_item(f"item{i}", it, 0, 0) for i, it in enumerate(items)]
    for w, it in zip(work, items):
        assert workload.validate(w, it.pixel_values.nbytes) is None
    inputs = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    with torch.inference_mode():
        return runner.run(work, inputs)


def test_rows_equal_transformers_alone_and_batched(qwen2_audio_tiny: Path, processor: HFAudioProcessor,
                                                   references: list[torch.Tensor]) -> None:
    workload, runner = _runner(qwen2_audio_tiny)
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    assert [it.num_tokens for it in items] == [r.shape[0] for r in references] == [75, 19, 10, 750]
    kinds = {work_item("k", it, 0, 0).kind for it in items}
    assert kinds == {"audio/input_features:128x3000,feature_attention_mask:3000"}  # every clip joins one forward
    for item, ref in zip(items, references):
        (alone,) = _run(workload, runner, [item])
        assert alone.shape == ref.shape and alone.dtype == torch.float32
        assert _relative_error(alone, ref) <= RTOL
    for i, (ours, ref) in enumerate(zip(_run(workload, runner, items), references)):
        assert ours.shape == ref.shape, i
        assert _relative_error(ours, ref) <= RTOL, i
    # without the 31 s clip the tower runs over the first clip's 300 frames and two more (304), not 3000
    mel_lengths = torch.tensor([int(it.pixel_values[-3000:].sum()) for it in items[:3]])  # each mask, flat at the end
    assert whisper_frames_needed(mel_lengths, 3000) == 304
    for i, (ours, ref) in enumerate(zip(_run(workload, runner, items[:3]), references)):
        assert ours.shape == ref.shape and _relative_error(ours, ref) <= RTOL, i


def test_bfloat16_rows(qwen2_audio_tiny: Path, processor: HFAudioProcessor, references: list[torch.Tensor]) -> None:
    workload, runner = _runner(qwen2_audio_tiny, "bfloat16")
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()[:2]]
    for ours, ref in zip(_run(workload, runner, items), references):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert _relative_error(ours, ref) <= BF16_RTOL


def test_only_the_audio_tower_and_projector_are_built_read_and_hashed(qwen2_audio_tiny: Path,
                                                                      tmp_path: Path) -> None:
    _, runner = _runner(qwen2_audio_tiny)
    built = {name.split(".")[1] for name, _ in runner.encoder.model.named_parameters()}  # type: ignore[attr-defined]
    assert built == {"audio_tower", "multi_modal_projector"}
    ckpt = tmp_path / "qwen2_audio"
    shutil.copytree(qwen2_audio_tiny, ckpt)
    names = vision_tensor_names(ckpt)["model.safetensors"]
    tensors = load_file(ckpt / "model.safetensors")
    audio = {n for n in tensors if n.startswith(("audio_tower.", "multi_modal_projector."))}  # the released names
    assert set(names) == audio and len(tensors) > len(audio)  # everything else is the language model's
    base = vision_weights_digest(ckpt)
    language = next(n for n in tensors if n not in audio)
    tensors[language] = tensors[language] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) == base
    tower = next(n for n in audio if "audio_tower.layers.1" in n)
    tensors[tower] = tensors[tower] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) != base


def test_tensor_parallel_is_refused_before_any_process_starts(qwen2_audio_tiny: Path) -> None:
    assert not serves_tp("qwen2_audio", 2)
    config = RuntimeConfig(model=qwen2_audio_tiny, device="cpu", tp_size=2)
    with pytest.raises(ValueError) as caught:
        encoder_workload(config, ModelFacts.from_checkpoint(qwen2_audio_tiny))
    assert str(caught.value) == TP_REFUSED.format(tp=2, model_type="qwen2_audio")
