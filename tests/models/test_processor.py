"""Eric's Qwen2-VL modality processor against transformers' AutoProcessor (torchvision backend): bit-exact
pixel_values and grids for images of many sizes/modes and for videos, with both resize backends."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from eric_epd.models.processor import ProcessedItem
from eric_epd.models.qwen2_vl_processor import Qwen2VLModalityProcessor, smart_resize
from eric_epd.models.registry import load_processor

BACKENDS = ("torch", "numpy")
# (width, height): tiny, huge, portrait, landscape, odd, extreme aspect ratio, exact multiples of 28
IMAGE_SIZES = [
    (20, 20),
    (1000, 700),
    (700, 1000),
    (300, 800),
    (800, 300),
    (97, 131),
    (33, 900),
    (56, 84),
    (224, 224),
    (1, 150),
]
VIDEO_SHAPES = [(5, 84, 112), (3, 250, 190), (1, 60, 60), (4, 28, 28)]  # (frames, height, width)


def _variant(src: Path, dst: Path, image: dict, video: dict) -> Path:
    """Copy a checkpoint's processor/tokenizer files with some preprocessing settings changed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, changes in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video)):
        cfg = json.loads((dst / name).read_text())
        cfg.update(changes)
        if "min_pixels" in changes:
            cfg["size"] = {"shortest_edge": changes["min_pixels"], "longest_edge": changes["max_pixels"]}
        (dst / name).write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ckpt_dirs(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tiny = qwen2_vl_tiny
    base = tmp_path_factory.mktemp("variants")
    # the real Qwen2-VL limits (images 56*56..28*28*1280 px; videos 128*28*28..28*28*768 px)
    real = _variant(
        tiny, base / "real", {"min_pixels": 3136, "max_pixels": 12845056}, {"min_pixels": 100352, "max_pixels": 602112}
    )
    other = _variant(
        tiny,
        base / "other",
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        {"cap_pixels_per_frame": True, "max_video_tokens": 64},
    )
    return {"tiny": tiny, "real": real, "other": other}


@pytest.fixture(scope="module")
def hf_processors(ckpt_dirs: dict[str, Path]) -> dict:
    from transformers import AutoProcessor

    return {k: AutoProcessor.from_pretrained(d) for k, d in ckpt_dirs.items()}


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    out = []
    for i, (w, h) in enumerate(IMAGE_SIZES):
        if i % 2:  # smooth, photo-like content
            y, x = np.mgrid[0:h, 0:w]
            arr = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], -1)
            arr = (arr + rng.normal(0, 8, arr.shape)).clip(0, 255).astype(np.uint8)
        else:  # noise: the worst case for rounding differences
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out.append(Image.fromarray(arr))
    return out


def _assert_same(item: ProcessedItem, hf_pixels: np.ndarray, hf_grid: list[int], merge: int = 2) -> None:
    assert item.grid_thw == tuple(hf_grid)
    assert item.num_tokens == int(np.prod(hf_grid)) // merge**2
    assert item.pixel_values.dtype == np.uint8  # levels: the worker normalizes them on its device
    pixels = item.float_pixels()
    assert pixels.dtype == np.float32
    assert pixels.shape == hf_pixels.shape
    np.testing.assert_array_equal(pixels, hf_pixels)  # bit-exact, not just close


@pytest.mark.parametrize("variant", ["tiny", "real", "other"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_images_equal_hf(ckpt_dirs: dict, hf_processors: dict, variant: str, backend: str) -> None:
    ours = Qwen2VLModalityProcessor(ckpt_dirs[variant], resize_backend=backend)
    hf = hf_processors[variant].image_processor
    for image in _images():
        ref = hf(images=[image], return_tensors="np")
        _assert_same(ours.process_image(image), ref["pixel_values"], ref["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_image_modes_equal_hf(ckpt_dirs: dict, hf_processors: dict, mode: str) -> None:
    ours = load_processor(ckpt_dirs["tiny"])
    image = _images()[5].convert(mode)
    ref = hf_processors["tiny"].image_processor(images=[image], return_tensors="np")
    _assert_same(ours.process_image(image), ref["pixel_values"], ref["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("variant", ["tiny", "real", "other"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_videos_equal_hf(ckpt_dirs: dict, hf_processors: dict, variant: str, backend: str) -> None:
    ours = Qwen2VLModalityProcessor(ckpt_dirs[variant], resize_backend=backend)
    hf = hf_processors[variant].video_processor
    rng = np.random.default_rng(3)
    for shape in VIDEO_SHAPES:
        frames = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        ref = hf(videos=[frames], do_sample_frames=False, return_tensors="np")
        _assert_same(ours.process_video(frames), ref["pixel_values_videos"], ref["video_grid_thw"][0].tolist())


def test_video_pads_odd_frame_count_with_last_frame(ckpt_dirs: dict) -> None:
    ours = load_processor(ckpt_dirs["tiny"])
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 56, 56, 3), dtype=np.uint8)
    padded = ours.process_video(np.concatenate([frames, frames[-1:]]))
    item = ours.process_video(frames)
    assert item.grid_thw == (2, 4, 4) and item.num_tokens == 8
    np.testing.assert_array_equal(item.pixel_values, padded.pixel_values)
    still = ours.process_video(frames[:1])  # one frame == the image path
    image = ours.process_image(Image.fromarray(frames[0]))
    assert image.repeat == 2 and 2 * image.pixel_values.shape[1] == still.pixel_values.shape[1]  # one frame is sent
    np.testing.assert_array_equal(still.float_pixels(), image.float_pixels())


def test_fingerprint(ckpt_dirs: dict) -> None:
    a, b = (load_processor(ckpt_dirs["tiny"]), Qwen2VLModalityProcessor(ckpt_dirs["tiny"], resize_backend="numpy"))
    assert a.modalities == ("image", "video")
    assert a.fingerprint("image") == b.fingerprint("image") and isinstance(a.fingerprint("image"), bytes)
    assert a.fingerprint("image") != a.fingerprint("video")
    real, other = load_processor(ckpt_dirs["real"]), load_processor(ckpt_dirs["other"])
    assert len({a.fingerprint("image"), real.fingerprint("image"), other.fingerprint("image")}) == 3
    assert len({a.fingerprint("video"), real.fingerprint("video"), other.fingerprint("video")}) == 3
    with pytest.raises(ValueError):
        a.fingerprint("audio")


def test_errors(ckpt_dirs: dict) -> None:
    ours = load_processor(ckpt_dirs["tiny"])
    with pytest.raises(ValueError, match="aspect ratio"):
        ours.process_image(Image.new("RGB", (1, 300)))
    with pytest.raises(ValueError, match="uint8"):
        ours.process_video(np.zeros((2, 56, 56, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        ours.process_video(np.zeros((2, 56, 56, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="unsupported modality"):
        ours.process("audio", np.zeros(3))
    assert smart_resize(20, 20, 28, 3136, 50176) == (56, 56)


@pytest.mark.parametrize("video_fps,max_frames", [(2.0, 32), (1.0, 32), (10.0, 6)])
def test_qwen25_second_per_grid_ts_equals_hf(
    qwen2_5_vl_tiny: Path, qwen2_vl_tiny: Path, video_fps: float, max_frames: int
) -> None:
    """Qwen2.5-VL's M-RoPE spaces video frames by time: the value Eric reports per video is the one transformers'
    processor computes from the same sampled frames and their metadata (temporal_patch_size / sampled fps)."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    from eric_epd.eric.decode import decode_video
    from eric_epd.media.limits import MediaLimits
    from eric_epd.testing.media import video_bytes

    data = video_bytes(20, 56, 56, fps=10, seed=1)  # 2 s
    frames, sampled_fps, _ = decode_video(data, MediaLimits(video_fps=video_fps, max_video_frames=max_frames))
    ours = load_processor(qwen2_5_vl_tiny).process_video(frames, sampled_fps)
    metadata = VideoMetadata(total_num_frames=20, fps=10.0, frames_indices=list(range(len(frames))))  # count matters
    hf = AutoProcessor.from_pretrained(qwen2_5_vl_tiny)(
        text=["<|vision_start|><|video_pad|><|vision_end|>"],
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="np",
    )
    assert list(ours.grid_thw) == hf["video_grid_thw"][0].tolist()
    assert ours.second_per_grid_ts == pytest.approx(float(hf["second_per_grid_ts"][0]))
    assert load_processor(qwen2_vl_tiny).process_video(frames, sampled_fps).second_per_grid_ts is None  # Qwen2-VL


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_prepare_many_keeps_order_and_per_item_errors(ckpt_dirs: dict, threads: int) -> None:
    """Items go to the pool in one chunk per thread; results come back in request order, a bad item as its own
    MediaError beside its neighbours' results, and each hash equals the one the item gets alone."""
    from eric_epd.eric.processor import Processor, model_fingerprint
    from eric_epd.media.limits import MediaLimits
    from eric_epd.media.url_policy import MediaError
    from eric_epd.models.facts import ModelFacts
    from eric_epd.testing.media import image_bytes, random_image

    processor = Processor(
        Qwen2VLModalityProcessor(ckpt_dirs["tiny"]),
        MediaLimits(),
        threads,
        model_fingerprint(ModelFacts.from_checkpoint(ckpt_dirs["tiny"]), ("float32", "float32")),
    )
    try:
        items = [("image", image_bytes(random_image(40 + 8 * i, 56, seed=i), "JPEG")) for i in range(5)]
        items.insert(2, ("image", b"not an image"))
        results = asyncio.run(processor.prepare_many(items))
        alone = [asyncio.run(processor.prepare_many([item]))[0] for item in items]
    finally:
        processor.close()
    assert isinstance(results[2], MediaError) and results[2].status == 400
    good = [r for i, r in enumerate(results) if i != 2]
    assert [r.hash for r in good] == [a.hash for i, a in enumerate(alone) if i != 2]
    assert len({r.hash for r in good}) == 5
    assert [r.item.grid_thw for r in good] == [a.item.grid_thw for i, a in enumerate(alone) if i != 2]


def test_hash_salt_covers_the_vision_weights_only(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Content hashes are salted with the vision weights: a copy of the checkpoint keeps them, a changed language
    model keeps them, a changed vision tensor (a fine-tuned tower under the same config) changes them."""
    from safetensors.torch import load_file, save_file

    from eric_epd.eric.processor import model_fingerprint
    from eric_epd.models.facts import ModelFacts

    def fingerprint(model_dir: Path) -> bytes:
        return model_fingerprint(ModelFacts.from_checkpoint(model_dir), ("float32", "float32"))

    def variant(name: str, key_part: str | None) -> Path:
        out = tmp_path / name
        shutil.copytree(qwen2_vl_tiny, out)
        if key_part is not None:
            weights = load_file(out / "model.safetensors")
            key = next(k for k in sorted(weights) if key_part in k)
            weights[key] = weights[key] + 0.25
            save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return out

    base = fingerprint(qwen2_vl_tiny)
    assert fingerprint(variant("copy", None)) == base
    assert fingerprint(variant("lm", "model.layers.0.mlp")) == base
    assert fingerprint(variant("tower", "visual.blocks.0.mlp")) != base


def test_hash_salt_covers_the_precision_the_tower_computes_and_sends(qwen2_vl_tiny: Path) -> None:
    """Rows computed or sent in another dtype are other rows: the fingerprint (and so every content hash) names
    the compute and row dtypes the workers resolve, "auto" resolved as they resolve it; the same settings give the
    same fingerprint (negative control)."""
    from eric_epd.eric.processor import model_fingerprint, tower_precision
    from eric_epd.models.facts import ModelFacts

    facts = ModelFacts.from_checkpoint(qwen2_vl_tiny)
    assert tower_precision("bfloat16", "float32", "cpu", facts) == ("bfloat16", "float32")
    assert tower_precision("auto", "bfloat16", "cuda", facts) == ("bfloat16", "bfloat16")
    assert tower_precision("float32", "auto", "cpu", facts) == ("float32", facts.output_dtype("auto"))
    f32 = model_fingerprint(facts, ("float32", "float32"))
    assert model_fingerprint(facts, ("float32", "float32")) == f32
    assert model_fingerprint(facts, ("bfloat16", "float32")) != f32
    assert model_fingerprint(facts, ("float32", "bfloat16")) != f32
