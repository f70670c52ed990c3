"""Eric's workload on the generic path (models/hf): items carry the HF processor's named tensors in one float32 frame,
batches join items whose tensors agree past dim 0, and the worker runs the model's own vision (or audio) tower at TP 1
(or, for facts.GENERIC_TOWER_TYPES, Eric's own tensor-parallel tower at any TP)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import numpy as np
import torch
from PIL import Image

from eric_epd.models.hf.encoder import HFVisionEncoder
from eric_epd.models.hf.processor import HFProcessedItem, cost_of
from eric_epd.models.hf.tensors import TensorSpec, join_items, signature, unpack_tensors
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem, pack_spec, unpack_spec
from eric_epd.runtime.workload import INPUT_BYTES
from eric_epd.wire.eric import Modality

logger = logging.getLogger(__name__)

TP_REFUSED = (
    "--tp {tp}: the generic path (model_type {model_type!r}, served by transformers' own classes) runs at "
    "--tp 1 only; scale it out with more Erics, or serve a family with a tower of Eric's own at --tp > 1"
)


class ItemEncoder(Protocol):
    """What a generic runner's worker calls: HFVisionEncoder or HFAudioEncoder (transformers' classes) or a tower of
    Eric's own behind the same interface (models/crop_tower.CropTowerEncoder: models/gemma3.py's, models/internvl.py's;
    models/qwen2_audio.Qwen2AudioTowerEncoder, models/qwen2_5_omni.Qwen2_5OmniTowerEncoder,
    models/qwen3_omni.Qwen3OmniTowerEncoder)."""

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch of one modality joined along dim 0."""
        ...


class GenericSpec(msgspec.Struct, array_like=True, frozen=True, tag="hf"):
    """One item of the generic path: its frame holds `tensors` one after another, each flattened, as float32."""

    modality: Modality
    tensors: tuple[TensorSpec, ...]
    rows: int
    """Rows the model gives this item (the placeholder's embedding positions in vLLM)."""


def generic_kind(spec: GenericSpec) -> str:
    """The scheduler batches one kind at a time: the modality and every tensor's shape past dim 0."""
    return f"{spec.modality}/{signature(spec.tensors)}"


def generic_work_item(key: str, item: HFProcessedItem, out_offset: int, out_nbytes: int) -> WorkItem:
    """The engine's work item for one item of the generic path."""
    spec = GenericSpec(item.modality, item.tensors, item.num_tokens)
    return WorkItem(key, generic_kind(spec), item.cost, out_offset, out_nbytes, pack_spec(spec))


@dataclass(frozen=True)
class GenericWorkload:
    """Read from the checkpoint once, in the router's process, then copied to the engine and the workers."""

    values_per_cost: int
    """Input values per unit of an item's cost (HFProcessedItem.cost)."""
    warmup_item: HFProcessedItem
    compute_dtype: str = "auto"
    """EricConfig.compute_dtype: the setting each worker resolves on its own device (models/compute_dtype.py)."""

    @classmethod
    def from_checkpoint(cls, model: Path, compute_dtype: str = "auto") -> GenericWorkload:
        """The workload of `model`, computing in `compute_dtype`; its warm-up item is a mid-grey 224x224 image
        through the model's processor (an audio model's: a second of silence)."""
        from eric_epd.models.hf.audio import HFAudioProcessor
        from eric_epd.models.registry import load_processor

        processor = load_processor(model)
        if isinstance(processor, HFAudioProcessor):
            rate = processor.sampling_rate
            silence = processor.process_audio(np.zeros(rate, np.float32), rate)
            return cls(processor.values_per_cost, silence, compute_dtype)
        image = Image.new("RGB", (224, 224), (128, 128, 128))
        grey = processor.process_image(image)  # type: ignore[attr-defined]
        return cls(processor.values_per_cost, grey, compute_dtype)  # type: ignore[arg-type]

    def validate(self, item: WorkItem, input_nbytes: int) -> str | None:
        """`Workload` hook: why the engine must refuse a generic item (spec, kind, cost or frame size), or None."""
        spec = unpack_spec(item, GenericSpec)
        if spec is None:
            return f"item {item.key}: not an item of the generic path"
        if item.kind != generic_kind(spec):
            return f"item {item.key}: kind {item.kind!r} does not match its {spec.modality} tensors"
        if spec.rows < 1 or not spec.tensors or any(min(t.shape, default=1) < 1 for t in spec.tensors):
            return f"item {item.key}: empty tensors or no rows"
        values = sum(t.numel for t in spec.tensors)
        if input_nbytes != values * INPUT_BYTES:
            return f"item {item.key}: {input_nbytes} input bytes, its tensors hold {values} float32 values"
        if item.cost != cost_of(values, self.values_per_cost):
            return f"item {item.key}: cost {item.cost} for {values} input values"
        return None

    def max_batch_input_bytes(self, config: RuntimeConfig) -> int:
        """`Workload` hook: the most input bytes one batch can carry under the batch cap."""
        return config.batch_limits().max_patches * self.values_per_cost * INPUT_BYTES

    def warmup(self, config: RuntimeConfig) -> tuple[WorkItem, np.ndarray]:
        """`Workload` hook: the start-up item (a mid-grey image through the model's processor) and its frame."""
        return generic_work_item("warm-up", self.warmup_item, 0, 0), self.warmup_item.pixel_values

    def load(self, config: RuntimeConfig, device: torch.device, tp: object) -> GenericRunner:
        """`Workload` hook: this worker's runner, the model's vision tower and projector on `device` in the compute
        dtype, its rows cast to the configured (row) dtype: Eric's own tower (this rank's shard) for
        GENERIC_TOWER_TYPES, else transformers' classes (TP 1 only)."""
        from eric_epd.models.compute_dtype import compute_dtype
        from eric_epd.models.facts import GENERIC_AUDIO_TYPES, GENERIC_OMNI_TYPES, GENERIC_TOWER_TYPES, generic_tower
        from eric_epd.models.registry import read_model_config, resolve_dtype

        world = getattr(tp, "world_size", 1)
        model_config = read_model_config(config.model)
        model_type = model_config.get("model_type")
        rows = resolve_dtype(config.dtype, model_config)
        if model_type not in GENERIC_TOWER_TYPES and world != 1:
            raise ValueError(TP_REFUSED.format(tp=world, model_type=model_type))
        dtype = compute_dtype(self.compute_dtype, rows, device)
        if model_type in GENERIC_TOWER_TYPES:
            encoder = generic_tower(model_type).ENCODER
            return GenericRunner(encoder.load(config.model, dtype, device, tp, model_config), row_dtype=rows)
        if model_type in GENERIC_AUDIO_TYPES:
            from eric_epd.models.hf.audio_encoder import HFAudioEncoder

            return GenericRunner(HFAudioEncoder.load(config.model, dtype, device), row_dtype=rows)
        if model_type in GENERIC_OMNI_TYPES:
            from eric_epd.models.hf.omni import HFOmniEncoder

            return GenericRunner(HFOmniEncoder.load(config.model, dtype, device), row_dtype=rows)
        return GenericRunner(HFVisionEncoder.load(config.model, dtype, device), row_dtype=rows)


@dataclass
class GenericRunner:
    """The model's vision (audio) tower: each batch split into items, items of one signature run together."""

    encoder: ItemEncoder
    dtype: torch.dtype = torch.float32
    """Inputs stay float32 on their way to `run` (integer tensors travel in them exactly); the encoder casts pixels
    to the model's (compute) dtype."""
    row_dtype: torch.dtype | None = None
    """The dtype of the rows sent (--dtype): each item's rows are cast to it before they leave `run` (None: left in
    the encoder's own)."""

    def run(self, items: list[WorkItem], inputs: torch.Tensor) -> list[torch.Tensor]:
        """`Runner` hook: each item's rows (in the row dtype), items of one modality with matching tensor shapes
        joined into one forward."""
        specs: list[GenericSpec] = []
        groups: dict[str, list[int]] = {}  # kind -> indices of the items that run in one forward
        for index, item in enumerate(items):
            spec = unpack_spec(item, GenericSpec)
            if spec is None:
                raise RuntimeError(f"item {item.key} is not an item of the generic path")
            specs.append(spec)
            groups.setdefault(generic_kind(spec), []).append(index)
        frames = inputs.reshape(-1).split([sum(t.numel for t in s.tensors) for s in specs])
        outputs: dict[int, torch.Tensor] = {}
        for members in groups.values():
            joined = join_items([unpack_tensors(specs[i].tensors, frames[i]) for i in members])
            rows = [specs[i].rows for i in members]
            outputs.update(zip(members, self.encoder.encode(joined, rows, specs[members[0]].modality)))
        if self.row_dtype is None:
            return [outputs[i] for i in range(len(items))]
        return [outputs[i].to(self.row_dtype) for i in range(len(items))]
