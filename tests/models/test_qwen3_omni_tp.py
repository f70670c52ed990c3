"""Qwen3-Omni-MoE's thinker on Eric's own towers (models/qwen3_omni.py: the chunked Conv2d-stem audio tower and the
Qwen3-VL vision tower), built from and reading only the thinker's tower tensors: rows for clips of odd lengths (a
sub-second one among them, resampled ones, one past the 8 s attention window) in both featurizations Eric uses for
this family (vLLM's hop-padded clips, SGLang's unpadded ones), images and a video equal transformers' thinker's
`get_audio_features`, `get_image_features` and `get_video_features` (DeepStack levels beside the merged rows), alone
and batched (a batch's sub-second clip as transformers computes it in that batch: its chunk padded to the longest),
at TP 1 in process and TP 2 over gloo in spawned processes, each rank holding its own shard."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload
from eric_epd.models.facts import ModelFacts, serves_tp
from eric_epd.models.hf.omni import HFOmniProcessor
from eric_epd.models.qwen3_omni import Qwen3OmniTowerEncoder, Qwen3OmniTowers, checkpoint_key
from eric_epd.models.registry import load_processor
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.testing.media import video_frames
from tests.support.generic_batches import (
    assert_alone_and_batched,
    generic_runner,
    joined_job,
    relative_error,
    run_batch,
    tower_tp2,
)
from tests.support.omni_reference import qwen3_omni_audio_batches, qwen3_omni_rows, sample_clips, sample_images

Served = tuple[GenericWorkload, GenericRunner]
AudioRefs = tuple[list[torch.Tensor], list[torch.Tensor]]

RTOL = 1e-5
"""Worst relative error (max |ours - transformers'| / max |transformers'|) in float32: the same modules on the same
inputs; a batch and the split over ranks change only the rounding of matmuls."""
CLIPS = ((2 * 16000 + 345, 16000), (7001, 16000), (2 * 44100 + 17, 44100), (13 * 16000 + 99, 16000))
"""(samples, rate): lengths off the 160-sample hop, a sub-second clip (its rows depend on its batch), one at
44.1 kHz (resampled first), one past the 8 s attention window."""
BF16_RTOL = 3e-2
"""bfloat16 against float32: bfloat16 roundings (2^-8 each) through the convolutions, two layers and the
projections."""
SHORT = 1
"""The sub-second clip's index in CLIPS."""
IMAGES = ((200, 150), (64, 64), (333, 97))


def _waves() -> list[tuple[np.ndarray, int]]:
    return sample_clips(CLIPS, 20)


def _images() -> list:
    return sample_images(IMAGES, 30)


def _video() -> np.ndarray:
    return video_frames(4, 120, 90, seed=3)


@pytest.fixture(scope="module")
def processor(qwen3_omni_tiny: Path) -> HFOmniProcessor:
    processor = load_processor(qwen3_omni_tiny)
    assert isinstance(processor, HFOmniProcessor)
    return processor


@pytest.fixture(scope="module")
def audio_refs(qwen3_omni_tiny: Path) -> dict[bool, AudioRefs]:
    """Per featurization (hop-padded: vLLM's; not: SGLang's), (each clip alone, the clips in one batch)."""
    return {padded: qwen3_omni_audio_batches(qwen3_omni_tiny, _waves(), padded) for padded in (True, False)}


@pytest.fixture(scope="module")
def vision_refs(qwen3_omni_tiny: Path) -> dict[str, list[torch.Tensor]]:
    return qwen3_omni_rows(qwen3_omni_tiny, [], _images(), [_video()])


@pytest.fixture(scope="module")
def served(qwen3_omni_tiny: Path) -> Served:
    workload, runner = generic_runner(qwen3_omni_tiny)
    assert isinstance(runner.encoder, Qwen3OmniTowerEncoder)  # Eric's own towers, at TP 1 too
    return workload, runner


def _clips(processor: HFOmniProcessor, hop_padded: bool) -> list:
    return [processor.process_audio(wave, rate, hop_padded) for wave, rate in _waves()]


@pytest.mark.parametrize("hop_padded", [True, False], ids=["vllm", "sglang"])
def test_audio_rows_equal_transformers_alone_and_batched(
    processor: HFOmniProcessor, served: Served, audio_refs: dict[bool, AudioRefs], hop_padded: bool
) -> None:
    items = _clips(processor, hop_padded)
    frames = [203, 44, 201, 1301] if hop_padded else [202, 43, 200, 1300]  # ceil or floor of samples / 160
    assert [it.feature_frames for it in items] == frames
    alone, batched = audio_refs[hop_padded]
    assert relative_error(alone[SHORT], batched[SHORT]) > 1e-3  # the sub-second clip's rows depend on its batch
    longer = [i for i in range(len(CLIPS)) if i != SHORT]
    assert_alone_and_batched(*served, [items[i] for i in longer], [alone[i] for i in longer], RTOL)
    (short,) = run_batch(*served, [items[SHORT]])
    assert short.shape == alone[SHORT].shape and relative_error(short, alone[SHORT]) <= RTOL
    for i, (ours, ref) in enumerate(zip(run_batch(*served, items), batched, strict=True)):
        assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, i


def test_bfloat16_rows(
    qwen3_omni_tiny: Path,
    processor: HFOmniProcessor,
    audio_refs: dict[bool, AudioRefs],
    vision_refs: dict[str, list[torch.Tensor]],
) -> None:
    workload, runner = generic_runner(qwen3_omni_tiny, "bfloat16")
    items = [*_clips(processor, True), processor.process_image(_images()[0])]
    refs = [*audio_refs[True][1], vision_refs["image"][0]]
    outputs = [*run_batch(workload, runner, items[:-1]), *run_batch(workload, runner, items[-1:])]
    for i, (ours, ref) in enumerate(zip(outputs, refs, strict=True)):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape, i
        assert relative_error(ours, ref) <= BF16_RTOL, i


def test_only_the_thinkers_tower_tensors_are_read(qwen3_omni_tiny: Path, served: Served) -> None:
    tower = served[1].encoder.tower  # type: ignore[attr-defined]
    assert {name.split(".")[0] for name, _ in tower.named_parameters()} == {"audio_tower", "visual"}
    tensors = load_file(qwen3_omni_tiny / "model.safetensors")
    towers = {n: t for n, t in tensors.items() if n.startswith(("thinker.audio_tower.", "thinker.visual."))}
    assert {checkpoint_key(n) for n in towers} == tower.expected_keys()  # every tower tensor read, nothing else
    config = ModelFacts.from_checkpoint(qwen3_omni_tiny).config
    with pytest.raises(KeyError, match=r"not a Qwen3-Omni audio or vision tower"):
        Qwen3OmniTowers(config).load_weights([("thinker.model.norm.weight", torch.zeros(64))])
    with pytest.raises(KeyError, match=r"missing.*visual\.deepstack_merger_list\.1\.ln_q\.weight"):
        Qwen3OmniTowers(config).load_weights(
            (n, t) for n, t in towers.items() if n != "thinker.visual.merger_list.1.ln_q.weight"
        )
    with pytest.raises(KeyError, match=r"missing.*audio_tower\.layers\.0\.self_attn\.k_proj\.bias"):
        Qwen3OmniTowers(config).load_weights(
            (n, t) for n, t in towers.items() if n != "thinker.audio_tower.layers.0.self_attn.k_proj.bias"
        )
    batch = {"input_features": torch.zeros(101, 128), "audio_feature_lengths": torch.tensor([101])}
    with pytest.raises(RuntimeError, match=r"give \[14\] rows, their specs say \[13\]"):
        served[1].encoder.encode(batch, [13], "audio")


def test_tensor_parallel_is_served_where_the_towers_split(qwen3_omni_tiny: Path) -> None:
    """--tp 2 splits the tiny towers' 2 heads each, the audio FFN and vision MLP of 128; --tp 3 is refused before any
    process starts, naming what does not split."""
    facts = ModelFacts.from_checkpoint(qwen3_omni_tiny)
    assert serves_tp("qwen3_omni_moe", 2)
    config = RuntimeConfig(model=qwen3_omni_tiny, device="cpu", tp_size=2)
    assert isinstance(encoder_workload(config, facts), GenericWorkload)
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        encoder_workload(RuntimeConfig(model=qwen3_omni_tiny, device="cpu", tp_size=3), facts)


# ---- TP 2 over gloo -------------------------------------------------------------------------------------------

SHARDS = {
    "audio_qkv": "audio_tower.layers.0.self_attn.qkv.weight",
    "audio_qkv_bias": "audio_tower.layers.0.self_attn.qkv.bias",
    "audio_fc2": "audio_tower.layers.0.fc2.weight",
    "vision_qkv": "visual.blocks.0.attn.qkv.weight",
    "vision_fc1": "visual.blocks.0.mlp.fc1.weight",
    "deepstack_fc": "visual.deepstack_merger_list.1.mlp.0.weight",
}
"""The tower parameters each rank hands back (its shard of each)."""


@pytest.fixture(scope="module")
def tp2_results(
    qwen3_omni_tiny: Path, processor: HFOmniProcessor, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    clips = {padded: _clips(processor, padded) for padded in (True, False)}
    images = [processor.process_image(image) for image in _images()]
    jobs = {f"audio-{padded}": joined_job("audio", items) for padded, items in clips.items()}
    jobs |= {
        f"audio-{padded}-{i}": joined_job("audio", [it])
        for padded, items in clips.items()
        for i, it in enumerate(items)
    }
    jobs |= {"image": joined_job("image", images), "video": joined_job("video", [processor.process_video(_video())])}
    jobs |= {f"image-{i}": joined_job("image", [it]) for i, it in enumerate(images)}
    return tower_tp2(Qwen3OmniTowerEncoder, qwen3_omni_tiny, jobs, SHARDS, tmp_path_factory.mktemp("qwen3-omni-tp2"))


def test_tp2_rows_equal_transformers_on_every_rank(
    audio_refs: dict[bool, AudioRefs], vision_refs: dict[str, list[torch.Tensor]], tp2_results: list[dict]
) -> None:
    """Both featurizations' clips alone and in one batch, three images alone and in one batch, a video: every rank's
    rows, replicated after the all-reduces."""
    expected: dict[str, list[torch.Tensor]] = {"image": vision_refs["image"], "video": vision_refs["video"]}
    expected |= {f"image-{i}": [ref] for i, ref in enumerate(vision_refs["image"])}
    for padded, (alone, batched) in audio_refs.items():
        expected[f"audio-{padded}"] = batched
        expected |= {f"audio-{padded}-{i}": [ref] for i, ref in enumerate(alone)}
    for result in tp2_results:
        for name, refs in expected.items():
            for i, (ours, ref) in enumerate(zip(result[name], refs, strict=True)):
                assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, (name, i)
    for name in expected:
        for a, b in zip(tp2_results[0][name], tp2_results[1][name], strict=True):
            assert torch.equal(a, b)


def test_tp2_ranks_hold_their_own_shards(qwen3_omni_tiny: Path, tp2_results: list[dict]) -> None:
    """Each rank holds one of the two heads of the audio tower's separate q, k and v (biases, k's included) and of
    the vision tower's fused qkv, half of the audio FFN, of the vision MLP and of a DeepStack merger's MLP."""
    full = load_file(qwen3_omni_tiny / "model.safetensors")
    audio, vision = "thinker.audio_tower.layers.0", "thinker.visual.blocks.0"
    for rank, result in enumerate(tp2_results):
        heads, half = slice(32 * rank, 32 * (rank + 1)), slice(64 * rank, 64 * (rank + 1))
        for leaf in ("weight", "bias"):
            shard = torch.cat([full[f"{audio}.self_attn.{p}_proj.{leaf}"][heads] for p in "qkv"])
            assert torch.equal(result["audio_qkv" if leaf == "weight" else "audio_qkv_bias"], shard)
        fused = full[f"{vision}.attn.qkv.weight"]
        assert torch.equal(result["vision_qkv"], torch.cat([fused[64 * j :][heads] for j in range(3)]))
        assert torch.equal(result["audio_fc2"], full[f"{audio}.fc2.weight"][:, half])
        assert torch.equal(result["vision_fc1"], full[f"{vision}.mlp.linear_fc1.weight"][half])
        merger = full["thinker.visual.merger_list.1.mlp.0.weight"]
        assert torch.equal(result["deepstack_fc"], merger[128 * rank : 128 * (rank + 1)])
