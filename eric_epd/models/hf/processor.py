"""The model's own HF processor as Eric's modality processor: one image (or video) in, the named tensors
`get_image_features` (`get_video_features`) takes, packed into one float32 frame, and the rows vLLM's placeholder
holds for it."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from eric_epd.models.facts import generic_modalities
from eric_epd.models.hf.adapters import layout_for
from eric_epd.models.hf.loader import hf_config, thinker
from eric_epd.models.hf.tensors import TensorSpec, pack_tensors
from eric_epd.models.hf.video import VideoPlan, vllm_video_processor_name
from eric_epd.models.processor import BaseModalityProcessor, ProcessedItem

logger = logging.getLogger(__name__)

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
"""The checkpoint files holding the processor's settings (hashed into every item's content hash)."""


@dataclass(frozen=True)
class HFProcessedItem(ProcessedItem):
    """An item of the generic path: `pixel_values` is its flat float32 frame, `tensors` says what it holds."""

    tensors: tuple[TensorSpec, ...] = ()
    cost: int = 1
    """What the batch cap counts: the frame's values in input patches of the tower (see values_per_patch)."""


class HFImageProcessor(BaseModalityProcessor):
    """Runs the checkpoint's processor on one image (or video) with the text that stands for one, as vLLM does; the
    rows are the image (video) tokens it expands that text into (the count transformers' own forward checks the
    features against). Thread-safe: each thread works on its own copy of the processor (its tokenizer is
    stateful)."""

    def __init__(self, model_dir: Path) -> None:
        config = hf_config(model_dir)
        self._processor, image_processor = checkpoint_processor(model_dir, "image_processor", "the generic path")
        layout = layout_for(config.model_type)
        if layout.check is not None:
            layout.check(image_processor)
        self._preprocess = layout.preprocess
        self._video_grid = layout.video_grid
        self._placeholder, self._token_id = placeholder_token(
            model_dir, self._processor, layout.placeholder, config, "image_token_id", "images go"
        )
        self._names = frozenset(image_processor.model_input_names)
        self.modalities = generic_modalities(config.model_type)
        self._video: _VideoFacts | None = None
        if "video" in self.modalities:
            self._video = _video_facts(model_dir, self._processor, config.model_type, self._token_id)
            if self._video.plan.call.image_size:  # as vLLM rebuilds it (InternVL)
                self._processor.video_processor = type(self._processor.video_processor).from_pretrained(
                    str(model_dir), local_files_only=True, size=image_processor.size
                )
        self.values_per_cost = values_per_patch(config)
        self._local = threading.local()
        settings = self._processor.image_processor.to_dict()
        if self._preprocess is not None:  # Eric's own code makes the tensors: its name is part of what they are
            settings["eric_preprocess"] = f"{self._preprocess.__module__}.{self._preprocess.__qualname__}"
        self._fingerprint = processor_fingerprint(Path(model_dir), self._processor, settings)

    def _mine(self) -> Any:
        """This thread's copy of the processor."""
        return thread_copy(self._local, self._processor)

    def process_image(self, image: Image.Image) -> HFProcessedItem:
        """One image through the checkpoint's own processor (or vLLM's computation where vLLM runs another:
        FamilyLayout.preprocess): its named tensors and the rows it will give."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        processor = self._mine()
        if self._preprocess is not None:  # vLLM's own processor is not the checkpoint's (Kimi-K2.5)
            tensors, rows = self._preprocess(image, processor.image_processor)
        else:
            tensors, rows = self._processor_tensors(processor, image)
        specs, frame = pack_tensors(tensors)
        grid = tensors.get("image_grid_thw")
        grid_thw = tuple(int(v) for v in grid.reshape(-1)[:3]) if grid is not None else (1, 1, rows)
        return HFProcessedItem(
            "image",
            frame,
            grid_thw,
            rows,
            tensors=specs,  # type: ignore[arg-type]
            cost=cost_of(frame.size, self.values_per_cost),
        )

    def _processor_tensors(self, processor: Any, image: Image.Image) -> tuple[dict[str, torch.Tensor], int]:
        """The checkpoint processor's named tensors for one image and its image tokens in the expanded text."""
        out = processor(text=[self._placeholder], images=[image], return_tensors="pt")
        rows = int((out["input_ids"] == self._token_id).sum())
        if rows < 1:
            raise ValueError("the processor gave this image no image tokens")
        return {k: v for k, v in out.items() if k in self._names and isinstance(v, torch.Tensor)}, rows

    def process_video(
        self, frames: np.ndarray, sampled_fps: float = 2.0, seconds: Sequence[float] | None = None
    ) -> HFProcessedItem:
        """Sampled frames [T, H, W, 3] (vLLM's, see frame_indices) through the checkpoint's own processor, as vLLM
        calls it for one video: its named tensors and the rows it will give."""
        if self._video is None:
            raise ValueError("this family's videos are not served by Eric's generic path")
        video = self._video
        as_images = video.plan.call.as_images
        if as_images is not None:  # vLLM's call: the frames as images, each with the family's image text
            out = self._mine()(
                text="".join("\t" + self._placeholder for _ in frames),
                return_tensors="pt",
                images=[Image.fromarray(frame) for frame in frames],
                **as_images,
            )
        else:
            out = self._mine()(
                text=[video.placeholder],
                videos=[frames],
                return_tensors="pt",
                **_video_kwargs(video.plan, len(frames), sampled_fps),
            )
        rows = int(torch.isin(out["input_ids"], torch.tensor(video.token_ids)).sum())
        if rows < 1:
            raise ValueError("the processor gave this video no video tokens")
        tensors = {k: v for k, v in out.items() if k in video.names and isinstance(v, torch.Tensor)}
        specs, frame = pack_tensors(tensors)
        grid = tensors.get("video_grid_thw") if self._video_grid else None
        grid_thw = tuple(int(v) for v in grid.reshape(-1)[:3]) if grid is not None else (1, 1, rows)
        return HFProcessedItem(
            "video",
            frame,
            grid_thw,
            rows,
            tensors=specs,  # type: ignore[arg-type]
            cost=cost_of(frame.size, self.values_per_cost),
        )

    def frame_indices(self, total: int, src_fps: float) -> list[int] | None:
        """The frames vLLM's video loader for this checkpoint hands its processor (models/hf/video.py)."""
        if self._video is None:
            return None
        return self._video.plan.frame_indices(total, src_fps, self._processor.video_processor)

    def fingerprint(self, modality: str) -> bytes:
        """What names the processor's output in content hashes (its config files and effective settings; for a
        video also the video processor's settings and the frames sampled)."""
        if modality == "video":
            video = getattr(self._processor, "video_processor", None)
            settings = json.dumps(video.to_dict() if video is not None else {}, sort_keys=True, default=str)
            plan = self._video.plan if self._video is not None else None
            return self._fingerprint + f"|video|{plan!r}|{settings}".encode()
        return self._fingerprint


def checkpoint_processor(model_dir: Path, part: str, needed_by: str) -> tuple[Any, Any]:
    """The checkpoint's own processor (transformers' AutoProcessor, nothing downloaded) and its `part` (e.g.
    "image_processor", "feature_extractor"); ValueError, naming `needed_by`, where it has no such part."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    sub = getattr(processor, part, None)
    if sub is None:
        raise ValueError(
            f"{model_dir}: the checkpoint's processor ({type(processor).__name__}) has no "
            f"{part.replace('_', ' ')}; {needed_by} needs one"
        )
    return processor, sub


def placeholder_token(
    model_dir: Path, processor: Any, attr: str, config: Any, token_key: str, what: str
) -> tuple[str, int]:
    """The text that stands for one item (the processor's `attr`) and the token id the expanded text holds its rows
    in (the (thinker's) config's `token_key`); ValueError, saying where `what` (e.g. "images go"), if either is
    missing."""
    placeholder: str = getattr(processor, attr, None) or ""
    token_id: int | None = getattr(thinker(config), token_key, None)
    if not placeholder or token_id is None:
        raise ValueError(
            f"{model_dir}: cannot tell where {what} in the text (processor.{attr}={placeholder!r}, "
            f"config {token_key}={token_id})"
        )
    return placeholder, token_id


@dataclass(frozen=True)
class _VideoFacts:
    """How the checkpoint's processor takes one video."""

    placeholder: str
    """The text that stands for one video (the processor expands it)."""
    token_ids: tuple[int, ...]
    """The tokens that hold its rows in the expanded text: the video token, or the image token where each frame is
    laid out as an image (GLM-4.1V, InternVL)."""
    names: frozenset[str]
    """The tensors the processor gives for it (its video processor's; InternVL renames them to the image ones)."""
    plan: VideoPlan
    """The frames vLLM takes for it and how vLLM calls the processor on them."""


def _video_facts(model_dir: Path, processor: Any, model_type: str, image_token_id: int) -> _VideoFacts:
    """How the checkpoint's processor takes one video; ValueError if it cannot tell where videos go."""
    video = getattr(processor, "video_processor", None)
    text = getattr(processor, "video_token", None)
    token_id = processor.tokenizer.convert_tokens_to_ids(text) if text else None  # as vLLM finds it
    if video is None or not isinstance(token_id, int) or token_id == processor.tokenizer.unk_token_id:
        raise ValueError(
            f"{model_dir}: cannot tell where videos go in the text (processor.video_token={text!r}, "
            f"its token id {token_id}, video processor {type(video).__name__})"
        )
    names = frozenset(video.model_input_names) | frozenset(processor.image_processor.model_input_names)
    plan = VideoPlan.of(model_type, vllm_video_processor_name(model_dir, model_type))
    return _VideoFacts(text, (token_id, image_token_id), names, plan)


def _video_kwargs(plan: VideoPlan, frames: int, sampled_fps: float) -> dict[str, Any]:
    """What vLLM passes the processor with a video besides its frames: for a family whose vLLM model hands over
    the loader's metadata, metadata of the frames taken and no further sampling (Eric's frames already are what the
    processor would sample: VideoPlan.frame_indices); nothing else (the processor's own settings)."""
    if not plan.call.metadata:
        return {}
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(total_num_frames=frames, fps=sampled_fps, frames_indices=list(range(frames)))
    return {"video_metadata": [metadata], "do_sample_frames": False}


def values_per_patch(config: Any) -> int:
    """Float32 values in one input patch of the tower (3 x patch^2): the unit of an item's cost, so the batch cap
    (--max-batch-patches) means about what it means for the hand-written towers."""
    patch = getattr(getattr(thinker(config), "vision_config", None), "patch_size", None) or 14
    if isinstance(patch, dict):
        patch = patch.get("height", 14)
    if isinstance(patch, list | tuple):
        patch = patch[0]
    return 3 * int(patch) ** 2


def cost_of(num_values: int, values_per_cost: int) -> int:
    """An item's cost: its input values in whole input patches, at least one."""
    return max(1, math.ceil(num_values / values_per_cost))


def processor_fingerprint(model_dir: Path, processor: Any, settings: dict[str, Any]) -> bytes:
    """Every processor setting that changes an item's tensors or row count: the processor files, `settings` (the
    effective settings of its image processor or feature extractor, class defaults included) and the transformers
    version whose code runs them."""
    import transformers

    h = hashlib.sha256(f"{type(processor).__name__}|{transformers.__version__}\0".encode())
    for name in PROCESSOR_FILES:
        path = model_dir / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"-") + b"\0")
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.digest()


def thread_copy(local: threading.local, processor: Any) -> Any:
    """This thread's copy of `processor` (made on first use: an HF processor is not safe across threads)."""
    mine = getattr(local, "processor", None)
    if mine is None:
        mine = local.processor = copy.deepcopy(processor)
    return mine
