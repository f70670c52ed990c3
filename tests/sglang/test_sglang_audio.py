"""Audio through SGLang 0.5.23's encoder protocol: a real Eric on the tiny Qwen2-Audio checkpoint behind SGLang's
real receivers (`--language-only --encoder-urls`, architecture allowed at arg_groups/pd_disaggregation_hook.py), whose
Qwen2-Audio processor (multimodal/processors/qwen_audio.py get_mm_data) expands each `<|AUDIO|>` from the part's
feature frames and places Eric's rows there. The prefill side is eric_epd.testing.sglang_prefill (stand-ins only for
SGLang's model runner: FakeSchedulerStandIn, CpuLandingPoolStandIn).

Qwen2.5-Omni (allowed there too) has no SGLang 0.5.23 model or multimodal processor of its own. With --model-impl
auto the receiver TokenizerManager makes finds no processor for it (it resolves the Transformers fallback only when
given the model config, which TokenizerManager does not pass); with --model-impl transformers it gets
TransformersAutoMultimodalProcessor, whose get_mm_data (BaseMultimodalProcessor's) reads IM_START_TOKEN_ID, never set
on it, so no prompt is rebuilt. The Omni tests show both, and that the receiver holds Eric's (and transformers')
audio, image and video rows and SGLang's own feature frames before that processor fails."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile
import torch

from eric_epd.eric.sglang.protocol import HEALTH_PNG
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import audio_bytes, data_url, image_bytes, random_image, video_bytes
from eric_epd.testing.sglang_prefill import Outcome, Prefill, WireCheck, unpack
from tests.support.audio_reference import transformers_audio_rows
from tests.support.helpers_sglang import eric_tensors, prefill_beside_eric
from tests.support.omni_reference import AUDIO_TEXT as OMNI_AUDIO
from tests.support.omni_reference import IMAGE_TEXT, VIDEO_TEXT, omni_rows

RTOL, ATOL = 1e-5, 1e-5  # float32 throughout (--sglang-dtype float32, prefill --dtype float32)
CLIPS = [(3 * 16000 + 7, 16000, 1), (16000 + 555, 16000, 2), (2 * 44100 + 5, 44100, 3)]
"""(frames, rate, seed) of mono WAV clips; 16 kHz ones are what SGLang's own loader reads without resampling."""
AUDIO_TAG = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def clip_url(frames: int, rate: int, seed: int) -> str:
    return data_url(audio_bytes(frames, rate, 1, "wav", seed), "audio/wav")


def prompt_for(num_clips: int) -> str:
    return "Listen to " + " and ".join([AUDIO_TAG] * num_clips) + " please."


@pytest.fixture(scope="module")
def stack(qwen2_audio_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prefill, EricServer]]:
    """The prefill host and one Eric on Qwen2-Audio (float32 rows, NIXL sessions from 127.0.0.1), started together."""
    with prefill_beside_eric(qwen2_audio_tiny, tmp_path_factory.mktemp("sglang-audio")) as servers:
        yield servers


@pytest.fixture(scope="module")
def reference(qwen2_audio_tiny: Path) -> dict[int, tuple[torch.Tensor, int]]:
    """Per clip: transformers' full-model rows at its audio tokens, and its processor's feature frames."""
    from transformers import AutoProcessor

    from eric_epd.media.resample import resample

    hf = AutoProcessor.from_pretrained(qwen2_audio_tiny)
    decoded = [soundfile.read(io.BytesIO(audio_bytes(f, r, 1, "wav", s)), dtype="float32") for f, r, s in CLIPS]
    rows = transformers_audio_rows(qwen2_audio_tiny, [(samples, rate) for samples, rate in decoded])
    frames = [
        int(
            hf.feature_extractor(
                resample(samples, rate, 16000),
                sampling_rate=16000,
                truncation=True,
                return_attention_mask=True,
                return_tensors="pt",
            )["attention_mask"].sum()
        )
        for samples, rate in decoded
    ]
    return dict(enumerate(zip(rows, frames)))


def check_audio(
    outcome: Outcome,
    clips: list[int],
    eric: EricServer,
    reference: dict[int, tuple[torch.Tensor, int]],
    audio_token_id: int,
) -> None:
    """The receiver holds, per clip and in order, Eric's rows and transformers' (float32); it handed SGLang's
    processor each clip's feature frames, and the prompt SGLang built holds one run of audio tokens per clip, as long
    as its rows."""
    assert outcome.ok, f"rank {outcome.rank}: {outcome.error_code} {outcome.error_msg}"
    got = [unpack(t) for t, m in zip(outcome.embeddings, outcome.modalities) if m == "AUDIO"]
    ours = eric_tensors(eric, [clip_url(*CLIPS[c]) for c in clips], "audio")
    assert len(got) == len(ours) == len(clips)
    for i, (mine, (eric_rows, _), c) in enumerate(zip(got, ours, clips)):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, eric_rows, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"clip {i}: {m}")
        torch.testing.assert_close(mine, reference[c][0], rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"clip {i}: {m}")
    assert outcome.audio_feature_lens == [reference[c][1] for c in clips]
    runs = [len(list(g)) for token, g in itertools.groupby(outcome.input_ids) if token == audio_token_id]
    assert runs == [reference[c][0].shape[0] for c in clips]


def audio_token_id(model: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model).audio_token_index)


def test_audio_part_message_is_the_embedding_data_sglang_sends(stack) -> None:
    """Eric's audio part header, read by SGLang's SafeUnpickler, equals SGLang's encoder's: the frame counts as an
    int64 tensor (its receiver flattens them), as for images and videos the grids."""
    prefill, _ = stack
    assert prefill.call(WireCheck(), str) == "ok"


def test_health_generate_encodes_audio(stack) -> None:
    """/health_generate (SGLang's encoder health probe) runs a real encode; an audio-only Eric encodes a second of
    silence instead of SGLang's probe image, and the probe's leases go back."""
    _, eric = stack
    assert httpx.get(eric.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(eric.url + "/health_generate", timeout=60).status_code == 200


@pytest.mark.parametrize("clips", [[0], [0, 1]])
def test_zmq_to_tokenizer_places_audio_as_sglangs_own_processing(
    stack, reference, qwen2_audio_tiny: Path, clips: list[int]
) -> None:
    """One part with 1 or 2 clips (16 kHz): SGLang's tokenizer-side receiver holds Eric's and transformers' rows,
    and the prompt and feature frames equal SGLang's own non-disaggregated processing of the same clips."""
    prefill, eric = stack
    urls = [clip_url(*CLIPS[c]) for c in clips]
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen2_audio_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[eric.url],
        audios=urls,
        prompt=prompt_for(len(urls)),
        dtype="float32",
        local_reference=True,
    )
    (outcome,) = result.outcomes
    check_audio(outcome, clips, eric, reference, audio_token_id(qwen2_audio_tiny))
    assert result.local is not None
    assert outcome.audio_feature_lens == result.local.audio_feature_lens
    assert outcome.input_ids == result.local.input_ids


@pytest.mark.parametrize("backend,tp", [("zmq_to_scheduler", 2), ("nixl", 1)])
def test_scheduler_ranks_receive_two_parts_of_audio(
    stack, reference, qwen2_audio_tiny: Path, backend: str, tp: int
) -> None:
    """Two clips split into two parts (the Eric listed twice, one clip each; one at 44.1 kHz): every scheduler rank
    (pushed over ZMQ, or pulled over NIXL) reassembles them in order."""
    prefill, eric = stack
    clips = [1, 2]
    result = prefill.job(
        kind="scheduler",
        model=str(qwen2_audio_tiny),
        backend=backend,
        encoder_urls=[eric.url, eric.url],
        audios=[clip_url(*CLIPS[c]) for c in clips],
        prompt=prompt_for(len(clips)),
        tp=tp,
        dtype="float32",
    )
    assert result.dispatch_error is None
    assert [o.rank for o in result.outcomes] == list(range(tp))
    for outcome in result.outcomes:
        check_audio(outcome, clips, eric, reference, audio_token_id(qwen2_audio_tiny))


def test_bad_audio_fails_the_request_with_erics_reason(stack, qwen2_audio_tiny: Path) -> None:
    """Bytes that are no audio, and an image sent to this audio-only Eric: the ranks abort the request with Eric's
    400 and its reason (no hang), and the Eric keeps serving."""
    prefill, eric = stack
    good = clip_url(*CLIPS[0])
    garbage = data_url(b"RIFF\x00\x00\x00\x00WAVEnot audio at all", "audio/wav")
    result = prefill.job(
        kind="scheduler",
        model=str(qwen2_audio_tiny),
        backend="zmq_to_scheduler",
        encoder_urls=[eric.url],
        audios=[good, garbage],
        prompt=prompt_for(2),
        tp=1,
        dtype="float32",
        timeout_s=60,
    )
    (outcome,) = result.outcomes
    assert not outcome.ok and outcome.error_code == 400, outcome
    assert "item 1" in outcome.error_msg and "could not decode audio" in outcome.error_msg, outcome.error_msg
    image = httpx.post(
        eric.url + "/encode",
        json={
            "req_id": "img_local_part_0",
            "num_parts": 1,
            "part_idx": 0,
            "modality": "IMAGE",
            "mm_items": [HEALTH_PNG],
        },
        timeout=30,
    )
    assert image.status_code == 400 and "unsupported modality: IMAGE" in image.json()["message"], image.text
    again = prefill.job(
        kind="scheduler",
        model=str(qwen2_audio_tiny),
        backend="zmq_to_scheduler",
        encoder_urls=[eric.url],
        audios=[good],
        prompt=prompt_for(1),
        tp=1,
        dtype="float32",
    )
    assert again.outcomes[0].ok, again.outcomes[0].error_msg


# ------------------------------------------------------------------------------------------------ Qwen2.5-Omni

OMNI_IMAGE = (120, 90, 7)
"""(width, height, seed) of the Omni request's image."""
OMNI_VIDEO = dict(num_frames=8, width=64, height=48, fps=4, seed=5)
"""Its video: 2 s, of which Eric (vLLM's Qwen2-VL sampling) takes 4 frames."""
OMNI_CLIP = 0
"""Its clip (CLIPS[0], 16 kHz)."""
SGLANG_OMNI_GAP = (
    "Failed to assemble multimodal inputs: 'TransformersAutoMultimodalProcessor' object has no "
    "attribute 'IM_START_TOKEN_ID'"
)
"""What SGLang 0.5.23 (--model-impl transformers) answers a disaggregated Qwen2.5-Omni request with, after its
receiver got every part."""
SGLANG_NO_OMNI_PROCESSOR = "No processor registered for architecture: ['Qwen2_5OmniForConditionalGeneration']"
"""What SGLang 0.5.23's receiver raises when TokenizerManager makes it (--model-impl auto)."""


def omni_urls() -> tuple[str, str, str]:
    """The Omni request's clip, image and video as data URLs."""
    return (
        clip_url(*CLIPS[OMNI_CLIP]),
        data_url(image_bytes(random_image(*OMNI_IMAGE))),
        data_url(video_bytes(**OMNI_VIDEO), "video/mp4"),
    )


@pytest.fixture(scope="module")
def omni_eric(qwen2_5_omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    """One Eric on the tiny Qwen2.5-Omni (float32 rows), shared by the Omni tests; the prefill host is `stack`'s."""
    eric = EricServer(
        qwen2_5_omni_tiny,
        log_path=tmp_path_factory.mktemp("sglang-omni") / "eric.log",
        extra_args=(
            "--dtype",
            "float32",
            "--sglang-dtype",
            "float32",
            "--transfer-backends",
            "shm",
            "--sglang-allowed-peer",
            "127.0.0.1/32",
        ),
    )
    with eric:
        yield eric


@pytest.fixture(scope="module")
def omni_reference(qwen2_5_omni_tiny: Path) -> dict[str, object]:
    """Transformers' thinker rows for the clip, the image and the video's frames as Eric samples them, and the clip's
    feature frames as SGLang's encoder computes them (the HF feature extractor's attention mask)."""
    from transformers import AutoProcessor

    from eric_epd.eric.decode import decode_video
    from eric_epd.media.limits import MediaLimits
    from eric_epd.models.registry import load_processor

    frames, rate, seed = CLIPS[OMNI_CLIP]
    samples, _ = soundfile.read(io.BytesIO(audio_bytes(frames, rate, 1, "wav", seed)), dtype="float32")
    sampling = load_processor(qwen2_5_omni_tiny).frame_indices
    video, _, _ = decode_video(video_bytes(**OMNI_VIDEO), MediaLimits(), sampling)
    rows = omni_rows(qwen2_5_omni_tiny, [(samples, rate)], [random_image(*OMNI_IMAGE)], [video])
    extractor = AutoProcessor.from_pretrained(qwen2_5_omni_tiny).feature_extractor
    mask = extractor([samples], sampling_rate=16000, return_attention_mask=True, return_tensors="pt")["attention_mask"]
    return {**rows, "feature_frames": [int(mask.sum())]}


def sglang_audio_tokens(feature_frames: list[int]) -> list[int]:
    """The audio token counts SGLang's own encoder computes from feature frames for qwen2_5_omni
    (EncoderPreprocessor._get_feat_extract_output_lengths)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.encoder.preprocessor import EncoderPreprocessor

    preprocessor = SimpleNamespace(model_type="qwen2_5_omni")
    return EncoderPreprocessor._get_feat_extract_output_lengths(preprocessor, torch.tensor(feature_frames)).tolist()


@pytest.mark.parametrize("backend", ["zmq_to_scheduler", "nixl"])
def test_omni_parts_reach_sglangs_receiver_which_cannot_place_them(
    stack, omni_eric, omni_reference, qwen2_5_omni_tiny: Path, backend: str
) -> None:
    """With --model-impl auto SGLang's tokenizer side cannot make its receiver. With --model-impl transformers, a
    clip, an image and a video: SGLang's scheduler-side receiver assembles, per modality, Eric's rows, equal to
    transformers' thinker's; the clip's feature frames it hands the processor are SGLang's own, and SGLang's token
    count from them is the clip's row count. SGLang's processor for this architecture then fails the request with
    its own error (no hang), and the Eric keeps serving."""
    prefill, _ = stack
    audio, image, video = omni_urls()
    job = dict(
        kind="scheduler",
        model=str(qwen2_5_omni_tiny),
        backend=backend,
        encoder_urls=[omni_eric.url],
        audios=[audio],
        images=[image],
        videos=[video],
        tp=1,
        dtype="float32",
        timeout_s=60,
        prompt=f"Hear {OMNI_AUDIO}, see {IMAGE_TEXT} and watch {VIDEO_TEXT}.",
    )
    with pytest.raises(RuntimeError) as refused:
        prefill.job(**job)
    assert SGLANG_NO_OMNI_PROCESSOR in str(refused.value)
    result = prefill.job(**job, model_impl="transformers")
    assert result.dispatch_error is None
    (outcome,) = result.outcomes
    assert not outcome.ok and SGLANG_OMNI_GAP in (outcome.error_msg or ""), outcome.error_msg
    assert sorted(outcome.received) == ["AUDIO", "IMAGE", "VIDEO"]
    for modality, url in (("audio", audio), ("image", image), ("video", video)):
        got = unpack(outcome.received[modality.upper()])
        ((eric_rows, grid),) = eric_tensors(omni_eric, [url], modality)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, eric_rows, rtol=RTOL, atol=ATOL, msg=lambda m, x=modality: f"{x}: {m}")
        torch.testing.assert_close(
            got, omni_reference[modality][0], rtol=RTOL, atol=ATOL, msg=lambda m, x=modality: f"{x}: {m}"
        )
        if modality != "audio":
            assert outcome.grid[f"{'img' if modality == 'image' else 'video'}_grid_thw"] == [grid]
    assert outcome.audio_feature_lens == omni_reference["feature_frames"]
    assert sglang_audio_tokens(outcome.audio_feature_lens) == [omni_reference["audio"][0].shape[0]]
    assert httpx.get(omni_eric.url + "/health_generate", timeout=60).status_code == 200
