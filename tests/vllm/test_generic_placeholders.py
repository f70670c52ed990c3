"""vLLM's own multimodal processor (no engine started) on every tiny family of Eric's generic path: for each image
(and each video of the families whose videos Eric encodes), the embedding positions of vLLM's placeholder are exactly
as many as the rows Eric answers, the tensors vLLM would feed its tower are Eric's, and the family's chat template
puts the placeholder where vLLM looks for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eric_epd.checkpoints.families import FAMILIES, ensure_family_checkpoint
from eric_epd.eric.decode import decode_video
from eric_epd.media.limits import MediaLimits
from eric_epd.models.facts import GENERIC_VIDEO_TYPES
from eric_epd.models.hf.processor import HFImageProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.testing.media import data_url, random_image, video_bytes

pytestmark = pytest.mark.exactness

SIZES = ((150, 100), (90, 200), (33, 47))
"""Wide, tall and smaller than one tile."""


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholder_embeds_equal_eric_rows(family: str, _checkpoint_cache: Path) -> None:
    from vllm.multimodal.inputs import VisionChunkImage

    ckpt = ensure_family_checkpoint(family)
    vllm_processor, prompt = _vllm_processor_and_prompt(ckpt, "image", "What is this?")
    eric = HFImageProcessor(ckpt)
    # Kimi-K2.5 (`use_unified_vision_chunk`): vLLM's chat parser hands images over as "vision_chunk" items
    modality = (
        "vision_chunk" if getattr(vllm_processor.info.get_hf_config(), "use_unified_vision_chunk", False) else "image"
    )
    for seed, (width, height) in enumerate(SIZES):
        image = random_image(width, height, seed=seed)
        data = [VisionChunkImage(type="image", image=image, uuid=None)] if modality == "vision_chunk" else [image]
        processed = vllm_processor(prompt, vllm_processor.info.parse_mm_data({modality: data}))
        (placeholder,) = processed["mm_placeholders"][modality]
        item = eric.process_image(image)
        assert placeholder.get_num_embeds() == item.num_tokens, (width, height)
        ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        if "image_grid_thw" in ours:  # Kimi-K2.5: vLLM's name for the same grid
            ours["grid_thws"] = ours["image_grid_thw"]
        for name, field in processed["mm_kwargs"][modality][0].items():
            theirs = field.data
            if name not in ours or not isinstance(theirs, torch.Tensor):
                continue  # vLLM's own bookkeeping (patch counts, token ids)
            mine = ours[name].reshape(theirs.shape)  # vLLM keeps one item without its batch dim
            if theirs.dtype == torch.uint8:  # normalised on the device by vLLM (Mistral 3, GLM-4.1V): the same math;
                continue  # Kimi-K2.5's through vLLM's device normalization: tests/models/test_kimi_processor.py
            torch.testing.assert_close(mine.to(theirs.dtype), theirs, rtol=0, atol=0, msg=f"{name} {width}x{height}")


VIDEOS = ((40, 8), (41, 8), (7, 1), (30, 30), (18, 4))
"""(frames, fps): sampled below the source rate (40, 41), every frame taken (7 at 1 fps: vLLM lets GLM-4.1V's
processor sample them again), a one-second video (2 frames at GLM-4.1V's 2 fps) and an odd sample count (9 of 18
at 4 fps)."""


VLLM_NAMES = {"pixel_position_ids_videos": "image_position_ids"}
"""vLLM's name for a video tensor -> Eric's, where the processor's image path made it (Gemma 4; vLLM renames
image_position_ids); otherwise vLLM's name less `_videos` (InternVL's processor, Gemma 4's image path)."""


@pytest.mark.parametrize("family", sorted(GENERIC_VIDEO_TYPES))
def test_video_placeholder_embeds_equal_eric_rows(family: str, _checkpoint_cache: Path) -> None:
    """Each video through vLLM's own chat media path (the loader it picks for the checkpoint's video processor) and
    multimodal processor: Eric's decoder takes frames vLLM's loader took, bit for bit, its tensors are the ones vLLM
    would feed its tower (so it took the frames vLLM's processor ended up with) and its rows as many as the
    placeholder's embedding positions."""
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

    ckpt = ensure_family_checkpoint(family)
    vllm_processor, prompt = _vllm_processor_and_prompt(ckpt, "video", "What happens?")
    video_processor = get_video_processor_cls_name_from_config(str(ckpt))
    eric = HFImageProcessor(ckpt)
    for seed, (count, fps) in enumerate(VIDEOS):
        data = video_bytes(count, 64, 48, fps=fps, seed=seed)
        frames, metadata = (
            MediaConnector().fetch_video(data_url(data, "video/mp4"), video_processor=video_processor).media
        )
        ours, sampled_fps, _ = decode_video(data, MediaLimits(), eric.frame_indices)
        theirs = dict(zip(metadata["frames_indices"], frames, strict=True))  # what vLLM's loader decoded, by frame
        for index, frame in zip(eric.frame_indices(count, fps), ours, strict=True):
            assert np.array_equal(frame, theirs[index]), (count, fps, index, metadata)
        processed = vllm_processor(prompt, vllm_processor.info.parse_mm_data({"video": [(frames, metadata)]}))
        (placeholder,) = processed["mm_placeholders"]["video"]
        item = eric.process_video(ours, sampled_fps)
        assert placeholder.get_num_embeds() == item.num_tokens, (count, fps)
        tensors = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        compared = []
        for name, field in processed["mm_kwargs"]["video"][0].items():
            ours_name = name if name in tensors else VLLM_NAMES.get(name, name.removesuffix("_videos"))
            if ours_name in tensors and isinstance(field.data, torch.Tensor):
                compared.append(name)
                theirs = field.data
                mine = tensors[ours_name].reshape(theirs.shape)
                if theirs.dtype == torch.uint8:  # GLM-4.1V: vLLM normalises on the device; Eric's are those pixels
                    mine = _pixels(mine, eric)
                torch.testing.assert_close(
                    mine.to(theirs.dtype), theirs, rtol=0, atol=0, msg=f"{name} {count} frames at {fps}"
                )
        assert "pixel_values_videos" in compared, compared
        assert family != "gemma4" or "pixel_position_ids_videos" in compared, compared


def _pixels(normalised: torch.Tensor, eric: HFImageProcessor) -> torch.Tensor:
    """The uint8 pixels that normalised patch rows [n, channels x ...] came from (the video processor's mean, std
    and rescale undone, rounded)."""
    video = eric._processor.video_processor
    rows = normalised.reshape(normalised.shape[0], 3, -1).double()
    mean, std = (torch.tensor(v, dtype=torch.float64)[None, :, None] for v in (video.image_mean, video.image_std))
    return ((rows * std + mean) / video.rescale_factor).round().reshape(normalised.shape)


@pytest.mark.parametrize("loader", ["opencv", "opencv_dynamic", "qwen2_vl"])
def test_frame_sampling_is_vllms_loader(loader: str) -> None:
    """Eric's sampling (models/hf/video.py) names the frames vLLM's loader computes, with the arguments vLLM calls it
    with (num_frames 32, the loader's default fps and max_duration), over short, long (past 300 s) and odd-rate
    videos; where vLLM's loader takes no frame, Eric refuses the video."""
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY
    from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata

    from eric_epd.models.hf.video import VideoSampling

    theirs = VIDEO_LOADER_REGISTRY.load(loader)
    ours = VideoSampling({"opencv_dynamic": "dynamic", "qwen2_vl": "qwen2_vl"}.get(loader, "uniform"))
    target = VideoTargetMetadata(num_frames=32, fps=-1 if loader == "opencv" else 2, max_duration=300)
    for total in (1, 2, 7, 31, 32, 33, 40, 41, 599, 601, 1000, 9001, 20000):
        for fps in (1.0, 2.5, 8.0, 23.976023976023978, 29.97002997002997, 30.0, 60.0):
            try:
                wanted = theirs.compute_frames_index_to_sample(VideoSourceMetadata(total, fps, total / fps), target)
            except ZeroDivisionError:  # qwen2_vl's on a one-frame video: it takes none
                wanted = []
            if not wanted:
                with pytest.raises(ValueError, match="takes no frame"):
                    ours.indices(total, fps)
                continue
            assert ours.indices(total, fps) == list(wanted), (total, fps)


def test_internvl_videos_take_the_image_size(tmp_path: Path, _checkpoint_cache: Path) -> None:
    """vLLM rebuilds InternVL's video processor with the image processor's size (interns1.py): with a checkpoint
    whose video size differs, Eric's frames are resized as vLLM's are (the image size), not as the file says."""
    import json
    import shutil

    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    ckpt = tmp_path / "internvl"
    shutil.copytree(ensure_family_checkpoint("internvl"), ckpt)
    config = json.loads((ckpt / "processor_config.json").read_text())
    config["video_processor"]["size"] = {"height": 32, "width": 32}
    (ckpt / "processor_config.json").write_text(json.dumps(config))
    vllm_processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=4096)
    )
    eric = HFImageProcessor(ckpt)
    frames, sampled_fps, _ = decode_video(video_bytes(8, 64, 48, fps=4, seed=3), MediaLimits(), eric.frame_indices)
    processed = vllm_processor("<video>\n", vllm_processor.info.parse_mm_data({"video": [frames]}))
    theirs = processed["mm_kwargs"]["video"][0]["pixel_values_videos"].data
    item = eric.process_video(frames, sampled_fps)
    ours = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))["pixel_values"]
    assert theirs.shape == (8, 3, 64, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _vllm_processor_and_prompt(ckpt: Path, part: str, text: str) -> tuple[Any, str]:
    """vLLM's own multimodal processor for `ckpt` (no engine), and the chat template's prompt for one `part`
    ("image" or "video") and `text`."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=4096)
    )
    prompt = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        [{"role": "user", "content": [{"type": part}, {"type": "text", "text": text}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return processor, prompt
