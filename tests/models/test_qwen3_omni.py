"""Qwen3-Omni-MoE's thinker: the tiny offline checkpoint loads as a released one does (transformers' full model and its
thinker alone read the same `thinker.*` tensors, per-expert MoE weights, no talker or code2wav), its processor expands
the Qwen3 placeholders by the family's own token counts, its rows are per-modality wide, and on Eric's generic path
(Eric's own towers, models/qwen3_omni.py, at TP 1 here; only they are built) its rows for clips of at least a second
(lengths off the hop, resampled), images and a video equal transformers' thinker's `get_audio_features`,
`get_image_features` and `get_video_features` (DeepStack levels beside the merged rows, as vLLM lays them out) on
vLLM's inputs, alone and batched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.models.facts import ModelFacts
from eric_epd.models.hf.loader import vision_tensor_names
from eric_epd.models.hf.omni import HFOmniProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.qwen3_omni import Qwen3OmniTowerEncoder
from eric_epd.models.registry import load_processor
from eric_epd.testing.media import audio_samples, random_image, video_frames
from tests.support.generic_batches import assert_alone_and_batched, generic_runner
from tests.support.omni_reference import qwen3_omni_rows

Served = tuple[GenericWorkload, GenericRunner]
Refs = dict[str, list[torch.Tensor]]

RTOL = 1e-5
"""Worst relative error (max |ours - transformers'| / max |transformers'|) in float32: the same modules on the same
inputs; a batch changes only the rounding of batched matmuls."""
CLIPS = ((2 * 16000 + 345, 16000), (2 * 44100 + 17, 44100), (13 * 16000 + 99, 16000))
"""(samples, rate): at least a second each (a shorter clip's rows depend on its batch, in vLLM too), lengths off the
160-sample hop, one at 44.1 kHz (resampled first), one past the 8 s attention window."""
IMAGES = ((200, 150), (64, 64), (333, 97))


def _waves() -> list[tuple[np.ndarray, int]]:
    return [(audio_samples(n, rate, seed=i)[:, 0], rate) for i, (n, rate) in enumerate(CLIPS)]


def _images() -> list:
    return [random_image(w, h, seed=10 + i) for i, (w, h) in enumerate(IMAGES)]


def _video() -> np.ndarray:
    return video_frames(4, 120, 90, seed=2)


@pytest.fixture(scope="module")
def processor(qwen3_omni_tiny: Path) -> HFOmniProcessor:
    processor = load_processor(qwen3_omni_tiny)
    assert isinstance(processor, HFOmniProcessor) and processor.modalities == ("image", "video", "audio")
    return processor


@pytest.fixture(scope="module")
def references(qwen3_omni_tiny: Path) -> Refs:
    return qwen3_omni_rows(qwen3_omni_tiny, _waves(), _images(), [_video()])


@pytest.fixture(scope="module")
def served(qwen3_omni_tiny: Path) -> Served:
    return generic_runner(qwen3_omni_tiny)


def test_checkpoint_loads_as_the_thinker_with_released_names(qwen3_omni_tiny: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeThinkerForConditionalGeneration

    with safe_open(str(qwen3_omni_tiny / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert {n.split(".")[1] for n in names} == {"audio_tower", "visual", "model", "lm_head"}
    assert all(n.startswith("thinker.") for n in names)
    assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in names  # per expert, as released
    assert "thinker.visual.merger_list.1.ln_q.weight" in names  # DeepStack mergers under the released name
    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_tiny)
    thinker = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(qwen3_omni_tiny)
    assert not full.has_talker
    ours, theirs = full.thinker.state_dict(), thinker.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert thinker.config.vision_config.deepstack_visual_indexes == [1, 2]
    vision = thinker.config.vision_config  # vLLM's tower reads these: a grid of 8x8 learned positions
    assert vision.image_size // vision.patch_size == 8 and vision.num_position_embeddings == 64
    assert vision.apply_vit_abs_pos_embed
    assert thinker.config.audio_config.n_window == 50 and thinker.config.audio_config.n_window_infer == 800


def test_processor_expands_the_qwen3_placeholders(qwen3_omni_tiny: Path) -> None:
    from transformers import AutoProcessor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    processor = AutoProcessor.from_pretrained(qwen3_omni_tiny)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|image_pad|><|vision_end|>hi" in prompt
    wave = audio_samples(2 * 16000 + 345, 16000, seed=0)[:, 0].astype(np.float32)
    out = processor(text=[prompt], audio=[wave], images=[random_image(96, 64, seed=1)], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    frames = int(out["feature_attention_mask"].sum())
    assert frames == len(wave) // 160  # padding to the longest clip, no truncation: every frame kept
    audio_id, image_id = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|audio_pad|>", "<|image_pad|>"))
    assert ids.count(audio_id) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    t, h, w = out["image_grid_thw"][0].tolist()
    assert (h, w) == (4, 6) and ids.count(image_id) == t * h * w // 4  # 16-pixel patches merged 2x2


def test_row_widths_by_modality(qwen3_omni_tiny: Path, qwen2_5_omni_tiny: Path) -> None:
    """Qwen3-Omni's image and video rows are DeepStack rows [main | level 1 | level 2], its audio rows the text
    width; Qwen2.5-Omni's are one width; Eric's output spec reserves each item at its modality's width."""
    from eric_epd.common.widths import embedding_width, embedding_widths
    from eric_epd.eric.answers import OutputSpec
    from eric_epd.models.facts import ModelFacts, read_config
    from eric_epd.wire.handles import EmbeddingHandle, HandleError, check_handle

    config = read_config(qwen3_omni_tiny)
    assert embedding_widths(config) == {"image": 192, "video": 192, "audio": 64}
    assert embedding_width(config) == 192  # images by default (the gateway's and profiler's embeds parts)
    assert embedding_widths(read_config(qwen2_5_omni_tiny)) == {"image": 64, "video": 64, "audio": 64}
    facts = ModelFacts.from_checkpoint(qwen3_omni_tiny)
    spec = OutputSpec(facts.embedding_width, "float32", {"image": 192, "video": 192, "audio": 64})
    assert (spec.nbytes(5, "image"), spec.nbytes(5, "audio"), spec.nbytes(5, "video")) == (3840, 1280, 3840)
    assert OutputSpec(8, "bfloat16").nbytes(3, "audio") == 48  # one width: every modality's
    url = "http://eric:1"

    def handle(width: int) -> EmbeddingHandle:
        key = "ab" * 32
        return EmbeddingHandle(key, (2, width), "float32", 8 * width, url, "i", f"{url}/v1/embeddings/{key}", lease="t")

    for width in (64, 192):
        check_handle(handle(width), (url,), {64, 192})
    with pytest.raises(HandleError, match=r"\[rows, 64 or 192\]"):
        check_handle(handle(128), (url,), {64, 192})
    with pytest.raises(HandleError, match=r"\[rows, 64\]"):
        check_handle(handle(192), (url,), 64)


def test_audio_rows_equal_transformers_alone_and_batched(
    processor: HFOmniProcessor, served: Served, references: Refs
) -> None:
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    assert [it.feature_frames for it in items] == [203, 201, 1301]  # ceil(samples / 160) after resampling to 16 kHz
    assert all(it.tensors is not None for it in items)
    ours = unpack_tensors(items[0].tensors, torch.from_numpy(items[0].pixel_values))
    assert ours["input_features"].shape == (203, 128)  # every frame of the hop-padded clip, none of padding
    assert_alone_and_batched(*served, items, references["audio"], RTOL)
    assert all(r.shape[1] == 64 for r in references["audio"])


def test_image_rows_equal_transformers_alone_and_batched(
    processor: HFOmniProcessor, served: Served, references: Refs
) -> None:
    items = [processor.process_image(image) for image in _images()]
    assert_alone_and_batched(*served, items, references["image"], RTOL)
    assert all(r.shape[1] == 3 * 64 for r in references["image"])  # [merged | level 1 | level 2]


def test_video_rows_equal_transformers(processor: HFOmniProcessor, served: Served, references: Refs) -> None:
    item = processor.process_video(_video())
    assert item.modality == "video"
    assert_alone_and_batched(*served, [item], references["video"], RTOL)


def test_only_the_towers_are_built_and_read(qwen3_omni_tiny: Path, served: Served) -> None:
    _, runner = served
    assert isinstance(runner.encoder, Qwen3OmniTowerEncoder)  # Eric's own towers (test_qwen3_omni_tp.py: TP 1, 2)
    built = {name.split(".")[0] for name, _ in runner.encoder.tower.named_parameters()}
    assert built == {"audio_tower", "visual"}
    with safe_open(str(qwen3_omni_tiny / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    towers = {n for n in names if n.startswith(("thinker.audio_tower.", "thinker.visual."))}
    assert set(vision_tensor_names(qwen3_omni_tiny)["model.safetensors"]) == towers  # only the towers are read
    facts = ModelFacts.from_checkpoint(qwen3_omni_tiny)
    assert facts.generic and facts.modalities == ("image", "video", "audio")
    assert facts.widths == {"image": 192, "video": 192, "audio": 64}
