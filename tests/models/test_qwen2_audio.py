"""Qwen2-Audio on Eric's generic path, on the tiny offline checkpoint loaded as a real one is: the worker runs Eric's
own audio tower and projector (models/qwen2_audio.py), built from and reading only their tensors, and its rows for an
audio item equal transformers' Qwen2AudioForConditionalGeneration's audio features (what its forward scatters into
the audio tokens' embeddings) for several odd lengths and rates, alone and batched, in float32 and bfloat16, at TP 1
in process and TP 2 over gloo in spawned processes (each rank holding its shard); transformers' classes on the
generic path (HFAudioEncoder) give them too; the language model's tensors are outside the digest."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.models.facts import ModelFacts, serves_tp
from eric_epd.models.hf.audio import HFAudioProcessor
from eric_epd.models.hf.audio_encoder import HFAudioEncoder, whisper_frames_needed
from eric_epd.models.hf.loader import vision_tensor_names
from eric_epd.models.hf.tensors import join_items, unpack_tensors
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.qwen2_audio import Qwen2AudioTower, Qwen2AudioTowerEncoder, checkpoint_key
from eric_epd.models.registry import load_processor, vision_weights_digest
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.testing.media import audio_samples
from tests.support.audio_reference import transformers_audio_rows
from tests.support.generic_batches import assert_alone_and_batched, generic_runner, relative_error, run_batch

RTOL = 1e-5
"""Worst relative error (max |ours - transformers'| / max |transformers'|) in float32: the same sums on the same
features; a batch, attention over packed items and TP's all-reduce change only their rounding."""
BF16_RTOL = 3e-2
"""bfloat16 against float32: bfloat16 roundings (2^-8 each) through two layers and the projector."""

CLIPS = ((3 * 16000 + 7, 16000), (12345, 16000), (17641, 44100), (31 * 16000, 16000))
"""(samples, rate): odd lengths, a 44.1 kHz clip (resampled first), and one past the extractor's 30 s."""


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
    workload, runner = generic_runner(ckpt, dtype)
    assert isinstance(runner.encoder, Qwen2AudioTowerEncoder)  # Eric's own tower, at TP 1 too
    return workload, runner


def test_rows_equal_transformers_alone_and_batched(
    qwen2_audio_tiny: Path, processor: HFAudioProcessor, references: list[torch.Tensor]
) -> None:
    workload, runner = _runner(qwen2_audio_tiny)
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    assert [it.num_tokens for it in items] == [r.shape[0] for r in references] == [75, 19, 10, 750]
    kinds = {work_item("k", it, 0, 0).kind for it in items}
    assert kinds == {"audio/input_features:128x3000,feature_attention_mask:3000"}  # every clip joins one forward
    assert_alone_and_batched(workload, runner, items, references, RTOL)
    # without the 31 s clip the tower runs over the first clip's 300 frames and two more (304), not 3000
    mel_lengths = torch.tensor([int(it.pixel_values[-3000:].sum()) for it in items[:3]])  # each mask, flat at the end
    assert whisper_frames_needed(mel_lengths, 3000) == 304
    for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items[:3]), references)):
        assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, i


def test_bfloat16_rows(qwen2_audio_tiny: Path, processor: HFAudioProcessor, references: list[torch.Tensor]) -> None:
    workload, runner = _runner(qwen2_audio_tiny, "bfloat16")
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()[:2]]
    for ours, ref in zip(run_batch(workload, runner, items), references):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        assert relative_error(ours, ref) <= BF16_RTOL


def test_transformers_classes_give_the_same_rows(
    qwen2_audio_tiny: Path, processor: HFAudioProcessor, references: list[torch.Tensor]
) -> None:
    """The generic path's transformers encoder (the audio block of Qwen2AudioModel.forward, trimmed alike), kept for
    audio families without a tower of Eric's own, on the same batch."""
    workload, _ = _runner(qwen2_audio_tiny)
    runner = GenericRunner(HFAudioEncoder.load(qwen2_audio_tiny, torch.float32, "cpu"))
    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    for i, (ours, ref) in enumerate(zip(run_batch(workload, runner, items), references)):
        assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, i


def test_only_the_audio_tower_and_projector_are_built_read_and_hashed(qwen2_audio_tiny: Path, tmp_path: Path) -> None:
    _, runner = _runner(qwen2_audio_tiny)
    tower = runner.encoder.tower  # type: ignore[attr-defined]
    assert {name.split(".")[0] for name, _ in tower.named_parameters()} == {"audio_tower", "multi_modal_projector"}
    ckpt = tmp_path / "qwen2_audio"
    shutil.copytree(qwen2_audio_tiny, ckpt)
    names = vision_tensor_names(ckpt)["model.safetensors"]
    tensors = load_file(ckpt / "model.safetensors")
    audio = {n for n in tensors if n.startswith(("audio_tower.", "multi_modal_projector."))}  # the released names
    assert set(names) == audio and len(tensors) > len(audio)  # everything else is the language model's
    assert {checkpoint_key(n) for n in audio} == tower.expected_keys()  # what the tower reads, all of it
    base = vision_weights_digest(ckpt)
    language = next(n for n in tensors if n not in audio)
    tensors[language] = tensors[language] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) == base
    tower_tensor = next(n for n in audio if "audio_tower.layers.1" in n)
    tensors[tower_tensor] = tensors[tower_tensor] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) != base


def test_loader_names_and_refusals(qwen2_audio_tiny: Path) -> None:
    released = {
        n: t
        for n, t in load_file(qwen2_audio_tiny / "model.safetensors").items()
        if n.startswith(("audio_tower.", "multi_modal_projector."))
    }
    config = ModelFacts.from_checkpoint(qwen2_audio_tiny).config
    ref = Qwen2AudioTower.from_checkpoint(qwen2_audio_tiny)
    moved = Qwen2AudioTower(config)
    moved.load_weights(("model." + n, t) for n, t in released.items())  # transformers 5's level
    for (name, a), (_, b) in zip(moved.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    k_bias = "audio_tower.layers.0.self_attn.k_proj.bias"
    with pytest.raises(KeyError, match="k_proj has no bias"):
        Qwen2AudioTower(config).load_weights([*released.items(), (k_bias, torch.zeros(64))])
    with pytest.raises(KeyError, match=r"missing.*layers\.1\.fc2\.weight"):
        fc2 = "audio_tower.layers.1.fc2.weight"
        Qwen2AudioTower(config).load_weights((n, t) for n, t in released.items() if n != fc2)
    with pytest.raises(KeyError, match="not a Qwen2-Audio audio tower"):
        Qwen2AudioTower(config).load_weights([("language_model.model.norm.weight", torch.zeros(64))])
    encoder = Qwen2AudioTowerEncoder(ref)
    batch = {"input_features": torch.zeros(1, 128, 3000), "feature_attention_mask": torch.ones(1, 3000)}
    with pytest.raises(RuntimeError, match=r"give \[750\] rows, their specs say \[749\]"):
        encoder.encode(batch, [749])
    with pytest.raises(RuntimeError, match="encodes audio, not image"):
        encoder.encode(batch, [750], "image")


def test_tensor_parallel_is_served_where_the_tower_splits(qwen2_audio_tiny: Path) -> None:
    """--tp 2 splits the tiny tower's 2 heads and FFN of 128; --tp 3 is refused before any process starts."""
    assert serves_tp("qwen2_audio", 2)
    facts = ModelFacts.from_checkpoint(qwen2_audio_tiny)
    config = RuntimeConfig(model=qwen2_audio_tiny, device="cpu", tp_size=2)
    assert isinstance(encoder_workload(config, facts), GenericWorkload)
    with pytest.raises(ValueError, match="attention heads 2 is not divisible by tensor-parallel size 3"):
        encoder_workload(RuntimeConfig(model=qwen2_audio_tiny, device="cpu", tp_size=3), facts)


# ---- TP 2 over gloo (the spawning pattern of test_gemma3_tower.py) ---------------------------------------------


def _tp_worker(
    rank: int, world: int, init: str, model_dir: str, batch: dict[str, torch.Tensor], rows: list[int], out_dir: str
) -> None:
    import torch.distributed as dist

    from tests.support.tp_spawn import leave_at_once

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        encoder = Qwen2AudioTowerEncoder.load(model_dir, torch.float32, "cpu", TPContext(rank, world))
        layer = encoder.tower.audio_tower.layers[0]
        torch.save(
            {
                "rows": encoder.encode(batch, rows),
                "qkv": layer.self_attn.qkv.weight,
                "qkv_bias": layer.self_attn.qkv.bias,
                "out_proj": layer.self_attn.out_proj.weight,
                "fc1": layer.fc1.weight,
                "fc2": layer.fc2.weight,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
    leave_at_once()  # its results are saved: no teardown in this process (tests/support/tp_spawn.py)


@pytest.fixture(scope="module")
def tp2_results(
    qwen2_audio_tiny: Path, processor: HFAudioProcessor, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    import torch.multiprocessing as mp

    from tests.support.tp_spawn import rendezvous

    items = [processor.process_audio(wave, rate) for wave, rate in _waves()]
    batch = join_items([unpack_tensors(it.tensors, torch.from_numpy(it.pixel_values)) for it in items])
    out_dir = tmp_path_factory.mktemp("qwen2-audio-tp2")
    mp.spawn(
        _tp_worker,
        args=(2, rendezvous(out_dir), str(qwen2_audio_tiny), batch, [it.num_tokens for it in items], str(out_dir)),
        nprocs=2,
        join=True,
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_tp2_rows_equal_transformers_on_every_rank(references: list[torch.Tensor], tp2_results: list[dict]) -> None:
    for result in tp2_results:
        for i, (ours, ref) in enumerate(zip(result["rows"], references, strict=True)):
            assert ours.shape == ref.shape and relative_error(ours, ref) <= RTOL, i
    for a, b in zip(tp2_results[0]["rows"], tp2_results[1]["rows"]):
        assert torch.equal(a, b)  # replicated after the all-reduces


def test_tp2_ranks_hold_their_own_shards(qwen2_audio_tiny: Path, tp2_results: list[dict]) -> None:
    """Each rank holds one of the two heads of q, k and v (k's bias part zero: Whisper's k_proj has none), half of
    out_proj's inputs, half of the FFN."""
    full = load_file(qwen2_audio_tiny / "model.safetensors")
    attn = "audio_tower.layers.0.self_attn"
    for rank, result in enumerate(tp2_results):
        heads = slice(32 * rank, 32 * (rank + 1))  # 2 heads of 32
        assert torch.equal(result["qkv"], torch.cat([full[f"{attn}.{p}_proj.weight"][heads] for p in "qkv"]))
        bias = [full[f"{attn}.q_proj.bias"][heads], torch.zeros(32), full[f"{attn}.v_proj.bias"][heads]]
        assert torch.equal(result["qkv_bias"], torch.cat(bias))
        assert torch.equal(result["out_proj"], full[f"{attn}.out_proj.weight"][:, heads])
        assert torch.equal(result["fc1"], full["audio_tower.layers.0.fc1.weight"][64 * rank : 64 * (rank + 1)])
        assert torch.equal(result["fc2"], full["audio_tower.layers.0.fc2.weight"][:, 64 * rank : 64 * (rank + 1)])
