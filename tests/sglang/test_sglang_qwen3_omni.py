"""Qwen3-Omni through SGLang 0.5.23's encoder protocol: a real Eric on the tiny Qwen3-Omni-MoE thinker behind SGLang's
real receivers (`Qwen3OmniMoeForConditionalGeneration` is in arg_groups/pd_disaggregation_hook.py's allow-list),
whose QwenVLImageProcessor (multimodal/processors/qwen_vl.py get_mm_data) expands each audio placeholder from the
part's feature frames with the Qwen3 token formula and places Eric's rows there: per modality one width (image and
video rows [merged | DeepStack levels], which SGLang's model splits at the text hidden size; audio rows the text
width). A video's part carries its processor grid and the second_per_grid_ts SGLang's own encoder sends, which its
Qwen3-Omni M-RoPE reads. The prefill side is eric_epd.testing.sglang_prefill (stand-ins only for SGLang's model
runner)."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import soundfile
import torch

from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import audio_bytes, data_url, image_bytes, random_image, video_bytes
from eric_epd.testing.sglang_prefill import Outcome, Prefill, unpack
from tests.support.helpers_sglang import eric_tensors, prefill_beside_eric
from tests.support.omni_reference import QWEN3_TEXT, qwen3_omni_rows
from tests.support.sglang_video import sglang_prepared_frames

RTOL, ATOL = 1e-5, 1e-5  # float32 throughout (--sglang-dtype float32, prefill --dtype float32)
CLIPS = [(2 * 16000 + 160 * 7, 16000, 1), (16000 + 555, 16000, 2)]
"""(frames, rate, seed) of mono 16 kHz WAV clips (what SGLang's own loader reads without resampling), each at least a
second; the second's length is no whole number of 160-sample hops."""
IMAGE = (64, 48, 7)
VIDEO = dict(num_frames=8, width=64, height=48, fps=4, seed=5)


def clip_url(frames: int, rate: int, seed: int) -> str:
    return data_url(audio_bytes(frames, rate, 1, "wav", seed), "audio/wav")


IMAGE_URL = data_url(image_bytes(random_image(*IMAGE)))
VIDEO_URL = data_url(video_bytes(**VIDEO), "video/mp4")


def prompt_for(num_clips: int, images: int = 1, videos: int = 0) -> str:
    tags = [QWEN3_TEXT["audio"]] * num_clips + [QWEN3_TEXT["image"]] * images + [QWEN3_TEXT["video"]] * videos
    return "Look and listen: " + " then ".join(tags) + " please."


@pytest.fixture(scope="module")
def stack(qwen3_omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prefill, EricServer]]:
    """The prefill host and one Eric on Qwen3-Omni (float32 rows, NIXL sessions from 127.0.0.1), started together."""
    with prefill_beside_eric(qwen3_omni_tiny, tmp_path_factory.mktemp("sglang-qwen3-omni")) as servers:
        yield servers


@pytest.fixture(scope="module")
def reference(qwen3_omni_tiny: Path) -> dict[str, list]:
    """Transformers' thinker rows: each clip as SGLang's processor takes it (16 kHz, not padded to whole hops), the
    image, and the frames SGLang's own preprocess_video makes of the video (its decoder, frame count and first
    resize); and the image's and the video's grids."""
    from transformers import AutoProcessor, Qwen3OmniMoeThinkerForConditionalGeneration

    frames, _ = sglang_prepared_frames(video_bytes(**VIDEO))
    decoded = [soundfile.read(io.BytesIO(audio_bytes(f, r, 1, "wav", s)), dtype="float32") for f, r, s in CLIPS]
    out = qwen3_omni_rows(
        qwen3_omni_tiny, [(samples, int(rate)) for samples, rate in decoded], [random_image(*IMAGE)], [frames]
    )
    out["vllm_audio"] = out.pop("audio")  # as vLLM 0.32 feeds its thinker: clips zero-padded to whole hops
    out["audio"] = []
    hf = AutoProcessor.from_pretrained(qwen3_omni_tiny)
    image = hf(text=[QWEN3_TEXT["image"]], images=[random_image(*IMAGE)], return_tensors="pt")
    video = hf(text=[QWEN3_TEXT["video"]], videos=[frames], return_tensors="pt")
    out["image_grid"], out["video_grid"] = image["image_grid_thw"].tolist(), video["video_grid_thw"].tolist()
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(qwen3_omni_tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        for (f, _, _), (samples, _) in zip(CLIPS, decoded):
            inputs = hf(text=[QWEN3_TEXT["audio"]], audio=[samples], return_tensors="pt")
            assert int(inputs["feature_attention_mask"].sum()) == f // 160
            rows = model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            out["audio"].append(rows.last_hidden_state)
            out.setdefault("frames", []).append(torch.tensor(f // 160))
    return out


def split_as_sglang(rows: torch.Tensor, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's own split of an image or video row (Qwen3VLForConditionalGeneration.separate_deepstack_embeds, which
    its Qwen3-Omni thinker inherits) into the merged row and its DeepStack levels, on the thinker's config."""
    from sglang.srt.models.qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration
    from transformers import AutoConfig

    thinker = AutoConfig.from_pretrained(model_dir).thinker_config
    stand_in = SimpleNamespace(
        num_deepstack_embeddings=len(thinker.vision_config.deepstack_visual_indexes),
        config=SimpleNamespace(hidden_size=thinker.text_config.hidden_size),
    )
    return Qwen3OmniMoeThinkerForConditionalGeneration.separate_deepstack_embeds(stand_in, rows)


def check_outcome(outcome: Outcome, clips: list[int], reference: dict[str, list], model_dir: Path) -> None:
    """The receiver holds, per item and in prompt order, transformers' rows at each modality's width (images and
    videos split as SGLang's model splits them); it handed SGLang's processor each clip's feature frames, and the
    prompt SGLang built holds one run of each modality's tokens per item, as long as its rows."""
    from transformers import AutoConfig

    assert outcome.ok, f"rank {outcome.rank}: {outcome.error_code} {outcome.error_msg}"
    thinker = AutoConfig.from_pretrained(model_dir).thinker_config
    hidden = thinker.text_config.hidden_size
    videos = outcome.modalities.count("VIDEO")
    assert outcome.modalities == ["AUDIO"] * len(clips) + ["IMAGE"] + ["VIDEO"] * videos
    got = [unpack(t) for t in outcome.embeddings]
    expected = [reference["audio"][c] for c in clips] + [reference["image"][0], *reference["video"][:videos]]
    for i, (mine, ref, modality) in enumerate(zip(got, expected, outcome.modalities)):
        assert mine.dtype == torch.float32
        assert mine.shape == ref.shape and mine.shape[1] == (hidden if modality == "AUDIO" else 3 * hidden)
        torch.testing.assert_close(mine, ref, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"item {i}: {m}")
        if modality != "AUDIO":
            merged, levels = split_as_sglang(mine, model_dir)
            assert torch.equal(merged, mine[:, :hidden]) and torch.equal(levels, mine[:, hidden:])  # the layout
    assert outcome.audio_feature_lens == [int(reference["frames"][c]) for c in clips]
    ids = {"AUDIO": thinker.audio_token_id, "IMAGE": thinker.image_token_id, "VIDEO": thinker.video_token_id}
    runs = [(token, len(list(g))) for token, g in itertools.groupby(outcome.input_ids) if token in ids.values()]
    assert runs == [(ids[m], r.shape[0]) for m, r in zip(outcome.modalities, expected)]


@pytest.mark.parametrize("clip", [0, 1])
def test_zmq_to_tokenizer_places_clip_and_image_as_sglangs_own_processing(
    stack, reference, qwen3_omni_tiny: Path, clip: int
) -> None:
    """One clip (whole hops, or not) and an image: SGLang's tokenizer-side receiver holds transformers' rows for
    each, and its prompt, feature frames, grids and M-RoPE positions equal SGLang's own non-disaggregated processing
    of the same media (one clip: SGLang's local Qwen3-Omni path reads the first clip's frames only, so two clips fail
    there with "IndexError: index 1 is out of bounds" in get_rope_index_qwen3_omni)."""
    prefill, eric = stack
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen3_omni_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[eric.url],
        audios=[clip_url(*CLIPS[clip])],
        images=[IMAGE_URL],
        prompt=prompt_for(1),
        dtype="float32",
        local_reference=True,
    )
    (outcome,) = result.outcomes
    check_outcome(outcome, [clip], reference, qwen3_omni_tiny)
    assert result.local is not None
    assert outcome.audio_feature_lens == result.local.audio_feature_lens
    assert outcome.input_ids == result.local.input_ids
    assert outcome.grid == result.local.grid
    assert outcome.mrope is not None and result.local.mrope is not None
    assert torch.equal(unpack(outcome.mrope), unpack(result.local.mrope))


def test_zmq_to_tokenizer_places_two_clips_and_an_image(stack, reference, qwen3_omni_tiny: Path) -> None:
    """Both clips and the image in one part each modality: every item's rows, in prompt order."""
    prefill, eric = stack
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen3_omni_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[eric.url],
        audios=[clip_url(*c) for c in CLIPS],
        images=[IMAGE_URL],
        prompt=prompt_for(2),
        dtype="float32",
    )
    check_outcome(result.outcomes[0], [0, 1], reference, qwen3_omni_tiny)


@pytest.mark.parametrize("backend,tp", [("zmq_to_scheduler", 2), ("nixl", 1)])
def test_scheduler_ranks_receive_clips_and_an_image_in_parts(
    stack, reference, qwen3_omni_tiny: Path, backend: str, tp: int
) -> None:
    """The clips and the image split into parts (the Eric listed twice): every scheduler rank (pushed over ZMQ, or
    pulled over NIXL) reassembles them in order, each modality at its own width."""
    prefill, eric = stack
    result = prefill.job(
        kind="scheduler",
        model=str(qwen3_omni_tiny),
        backend=backend,
        encoder_urls=[eric.url, eric.url],
        audios=[clip_url(*c) for c in CLIPS],
        images=[IMAGE_URL],
        prompt=prompt_for(2),
        tp=tp,
        dtype="float32",
    )
    assert result.dispatch_error is None
    assert [o.rank for o in result.outcomes] == list(range(tp))
    for outcome in result.outcomes:
        check_outcome(outcome, [0, 1], reference, qwen3_omni_tiny)


def test_a_video_reaches_the_receiver_with_its_grid_and_sglangs_seconds_per_grid(
    stack, reference, qwen3_omni_tiny: Path
) -> None:
    """An image and a video: the video's part carries its processor grid (video_grid_thw) and the second_per_grid_ts
    SGLang's own encoder sends for this family (temporal_patch_size / 2), which SGLang's get_rope_index_qwen3_omni
    reads; the receiver holds transformers' rows for both, the grids transformers' processor gives, one run of video
    tokens as long as its rows, and M-RoPE positions equal to transformers' own get_rope_index on the same prompt,
    grids and seconds."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    prefill, eric = stack
    result = prefill.job(
        kind="scheduler",
        model=str(qwen3_omni_tiny),
        backend="zmq_to_scheduler",
        encoder_urls=[eric.url],
        images=[IMAGE_URL],
        videos=[VIDEO_URL],
        audios=[],
        prompt=prompt_for(0, videos=1),
        tp=1,
        dtype="float32",
    )
    assert result.dispatch_error is None
    (outcome,) = result.outcomes
    check_outcome(outcome, [], reference, qwen3_omni_tiny)
    assert outcome.grid == {"img_grid_thw": reference["image_grid"], "video_grid_thw": reference["video_grid"]}
    assert outcome.extra == {"second_per_grid_ts": [1.0]}  # the tiny checkpoint's temporal patch of 2, over 2 fps
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(qwen3_omni_tiny, dtype=torch.float32)
    ids = torch.tensor([outcome.input_ids])
    positions, _ = model.get_rope_index(
        ids,
        torch.tensor(reference["image_grid"]),
        torch.tensor(reference["video_grid"]),
        torch.ones_like(ids),
        second_per_grids=torch.tensor([1.0]),
    )
    assert outcome.mrope is not None
    assert torch.equal(unpack(outcome.mrope).to(torch.int64), positions[:, 0].to(torch.int64))


def test_eric_answers_vllm_hop_padded_clips_and_sglang_unpadded_ones(stack, reference) -> None:
    """The same clips on Eric's native (vLLM) route: rows of the clip zero-padded to whole hops, as vLLM 0.32 feeds
    its thinker. For the whole-hop clip they are SGLang's rows too; for the other they are not (one frame more), and
    SGLang's receivers got the unpadded clip's rows and frame count (the tests above)."""
    _, eric = stack
    (whole, _), (odd, _) = eric_tensors(eric, [clip_url(*c) for c in CLIPS], "audio")
    for i, rows in enumerate((whole, odd)):
        torch.testing.assert_close(rows, reference["vllm_audio"][i], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(whole, reference["audio"][0], rtol=RTOL, atol=ATOL)
    assert odd.shape == reference["audio"][1].shape  # 103 and 104 frames give the same 14 tokens ...
    assert not torch.allclose(odd, reference["audio"][1], rtol=1e-3, atol=1e-3)  # ... but not the same rows
