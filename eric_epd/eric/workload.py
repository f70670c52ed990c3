"""Eric's workload on the shared skeleton: media items' pixel rows in, the vision tower's merged tokens out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from eric_epd.models.facts import ModelFacts
from eric_epd.models.processor import PixelNormalize, ProcessedItem, repeat_rows
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import INPUT_DTYPES, WorkItem, pack_spec, unpack_spec
from eric_epd.runtime.workload import INPUT_BYTES, Workload

MODALITIES = ("image", "video")


class Levels(msgspec.Struct, array_like=True, frozen=True):
    """How uint8 levels become the encoder's float32 input (PixelNormalize's settings, from the checkpoint's
    processor config)."""

    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]


class EncodeSpec(msgspec.Struct, array_like=True, frozen=True, tag="encode"):
    """One preprocessed media item; its pixels are [num_patches, patch_dim] rows: float32, or uint8 levels that
    `levels` normalizes on the worker's device."""

    modality: str
    grid_thw: tuple[int, int, int]
    patch_dim: int
    """Values per row the encoder takes."""
    levels: Levels | None = None
    repeat: int = 1
    """With `levels`: the rows sent hold patch_dim / repeat values, each channel block of which the worker repeats
    `repeat` times (an image's one frame over the temporal patch: ProcessedItem.repeat)."""


def work_item(key: str, item: ProcessedItem, out_offset: int, out_nbytes: int) -> WorkItem:
    """The engine's work item for a preprocessed item (an item of the generic path carries its named tensors)."""
    from eric_epd.models.hf.processor import HFProcessedItem

    if not len(item.pixel_values):  # never: an alias hit (eric/alias.py, tensors left out) is leased, not encoded
        raise ValueError(f"item {key} has no input tensors (an aliased item) and cannot be encoded")
    if isinstance(item, HFProcessedItem):
        from eric_epd.eric.generic import generic_work_item

        return generic_work_item(key, item, out_offset, out_nbytes)
    rows, sent = item.pixel_values.shape
    levels = Levels(*item.levels.settings) if item.levels is not None else None
    spec = pack_spec(EncodeSpec(item.modality, item.grid_thw, sent * item.repeat, levels, item.repeat))
    return WorkItem(key, item.modality, rows, out_offset, out_nbytes, spec, str(item.pixel_values.dtype))


def encoder_workload(
    config: RuntimeConfig, facts: ModelFacts, compile: str = "none", compute_dtype: str = "auto"
) -> Workload:
    """The workload serving config.model: its hand-written tower's (run as `compile` says: EricConfig.compile), or
    the generic path's (TP 1 only, but for facts.GENERIC_TOWER_TYPES, whose tower of Eric's own must split over
    --tp; never compiled); either computes in `compute_dtype` (EricConfig.compute_dtype). ValueError when Eric cannot
    serve the checkpoint, naming what it serves."""
    from eric_epd.eric.generic import TP_REFUSED, GenericWorkload
    from eric_epd.models.facts import GENERIC_TOWER_TYPES, generic_tower, serves_tp
    from eric_epd.models.registry import check_servable

    if not facts.generic:
        return EncoderWorkload.from_facts(facts, compile, compute_dtype)
    if compile != "none":
        raise ValueError(
            f"--compile {compile} compiles the Qwen families' towers; {facts.model_type} takes the "
            "generic path, which runs eagerly (leave out --compile)"
        )
    check_servable(config.model)
    if not serves_tp(facts.model_type, config.tp_size):
        raise ValueError(TP_REFUSED.format(tp=config.tp_size, model_type=facts.model_type))
    if config.tp_size > 1 and facts.model_type in GENERIC_TOWER_TYPES:
        generic_tower(facts.model_type).check_tp(facts.config, config.tp_size)
    return GenericWorkload.from_checkpoint(config.model, compute_dtype)


@dataclass(frozen=True)
class EncoderWorkload:
    """Read from the checkpoint once, in the router's process, then copied to the engine and the workers."""

    merge_unit: int
    """Patches per output token (the spatial merge size squared)."""
    pixel_row: int
    """Values per patch row the encoder takes (channels x temporal patch x patch^2)."""
    compile: str = "none"
    """EricConfig.compile: "inductor" compiles the tower's parts at load; the warm-up batch compiles them."""
    compute_dtype: str = "auto"
    """EricConfig.compute_dtype: the setting each worker resolves on its own device (models/compute_dtype.py)."""
    temporal_patch: int = 1
    """Frames per patch row: the only `repeat` an item's rows may ask for (an image's one frame)."""

    @classmethod
    def from_facts(cls, facts: ModelFacts, compile: str = "none", compute_dtype: str = "auto") -> EncoderWorkload:
        """The workload of the checkpoint `facts` describe (the router's, read once), run as `compile` says in
        `compute_dtype`."""
        return cls(facts.merge_unit, facts.pixel_row, compile, compute_dtype, facts.temporal_patch)

    def validate(self, item: WorkItem, input_nbytes: int) -> str | None:
        """`Workload` hook: why the engine must refuse this encode item (spec, modality, grid, byte count), or None."""
        spec = unpack_spec(item, EncodeSpec)
        if spec is None:
            return f"item {item.key}: not an encode item"
        if spec.modality not in MODALITIES or item.kind != spec.modality:
            return f"unsupported modality {spec.modality!r}"
        t, h, w = spec.grid_thw
        if min(t, h, w) < 1 or t * h * w != item.cost:
            return f"item {item.key}: grid {spec.grid_thw} does not match {item.cost} patches"
        if item.cost % self.merge_unit:
            return f"item {item.key}: {item.cost} patches is not a whole number of merged tokens"
        if (item.input_dtype == "uint8") != (spec.levels is not None):
            return f"item {item.key}: {item.input_dtype} pixels {'without' if spec.levels is None else 'with'} levels"
        if spec.patch_dim != self.pixel_row:
            return f"item {item.key}: rows of {spec.patch_dim} values; this encoder takes {self.pixel_row}"
        if (problem := self._levels_problem(spec)) is not None:
            return f"item {item.key}: {problem}"
        sent = spec.patch_dim // spec.repeat
        if input_nbytes != item.cost * sent * INPUT_DTYPES[item.input_dtype]:
            return f"item {item.key}: {input_nbytes} pixel bytes, expected {item.cost}x{sent} {item.input_dtype}"
        return None

    def _levels_problem(self, spec: EncodeSpec) -> str | None:
        """Why `spec`'s levels or repeat cannot give the encoder's rows (the worker would fail the whole batch or
        lay the rows out wrongly), or None. Repeated rows are an image's one frame over the temporal patch."""
        if spec.repeat not in {1, self.temporal_patch}:
            return f"rows repeated {spec.repeat} times; this encoder's temporal patch is {self.temporal_patch}"
        if spec.repeat > 1 and (spec.levels is None or spec.grid_thw[0] != 1 or spec.modality != "image"):
            return "repeated rows are an image's one frame of uint8 levels"
        if spec.levels is None:
            return None
        channels = len(spec.levels.mean)
        if channels < 1 or len(spec.levels.std) != channels or (spec.patch_dim // spec.repeat) % channels:
            return f"levels of {channels} means and {len(spec.levels.std)} stds for rows of {spec.patch_dim} values"
        return None

    def max_batch_input_bytes(self, config: RuntimeConfig) -> int:
        """`Workload` hook: the pixel bytes of a batch at the patch cap."""
        return config.batch_limits().max_patches * self.pixel_row * INPUT_BYTES

    def warmup(self, config: RuntimeConfig) -> tuple[WorkItem, np.ndarray]:
        """`Workload` hook: a blank image of two merge windows per side, run by every rank before ready."""
        side = 2 * math.isqrt(self.merge_unit)  # two merge windows per side
        spec = EncodeSpec("image", (1, side, side), self.pixel_row)
        return WorkItem("warm-up", "image", side * side, 0, 0, pack_spec(spec)), np.zeros(
            (side * side, self.pixel_row), np.float32
        )

    def load(self, config: RuntimeConfig, device: torch.device, tp: object) -> EncoderRunner:
        """`Workload` hook: this rank's vision encoder, loaded from the checkpoint in the compute dtype, its rows
        cast to the configured (row) dtype."""
        from eric_epd.models.compute_dtype import compute_dtype
        from eric_epd.models.registry import load_encoder, read_model_config, resolve_dtype

        model_config = read_model_config(config.model)  # this worker process's one read
        rows = resolve_dtype(config.dtype, model_config)
        dtype = compute_dtype(self.compute_dtype, rows, device)
        encoder = load_encoder(config.model, dtype, device, tp, model_config)  # type: ignore[arg-type]
        if self.compile == "inductor":
            encoder.compile_parts()
        return EncoderRunner(encoder, dtype, self.merge_unit, rows)


@dataclass
class EncoderRunner:
    """The vision tower of one rank: a batch of pixel rows in, each item's merged tokens out."""

    encoder: torch.nn.Module
    dtype: torch.dtype
    """The compute dtype: the encoder's, which the worker casts the inputs to."""
    merge_unit: int
    row_dtype: torch.dtype
    """The dtype of the rows sent (--dtype): the encoder's rows are cast to it before they leave `run`."""
    _normalizers: dict[Levels, PixelNormalize] = field(default_factory=dict)
    """PixelNormalize per Levels seen (each checked against its table once, when built)."""

    def run(self, items: list[WorkItem], inputs: torch.Tensor) -> list[torch.Tensor]:
        """`Runner` hook: the encoder over the batch's pixel rows, cast to the row dtype and split into each item's
        merged tokens."""
        specs = [unpack_spec(i, EncodeSpec) for i in items]
        if any(s is None for s in specs):
            raise RuntimeError("a batch item is not an encode item")
        grid = torch.tensor(
            [list(s.grid_thw) for s in specs],
            dtype=torch.int64,  # type: ignore[union-attr]
            device=inputs.device,
        )
        out = self.encoder(self._pixels(specs, inputs.reshape(-1)), grid)  # type: ignore[arg-type]
        counts = [i.cost // self.merge_unit for i in items]
        if out.dim() != 2 or out.shape[0] != sum(counts):
            raise RuntimeError(f"encoder returned shape {list(out.shape)}, expected {sum(counts)} tokens")
        return list(out.to(self.row_dtype).split(counts))

    def _pixels(self, specs: list[EncodeSpec], flat: torch.Tensor) -> torch.Tensor:
        """The batch's rows in the compute dtype from its flat inputs: uint8 levels normalized and repeated item by
        item (float32 arithmetic, on the device: HF's processor's values), float32 rows cast."""
        patch_dim = specs[0].patch_dim
        if any(s.patch_dim != patch_dim for s in specs):
            raise RuntimeError(f"a batch mixes rows of {sorted({s.patch_dim for s in specs})} values")
        if flat.dtype != torch.uint8:
            return flat.view(-1, patch_dim).to(self.dtype)
        counts = [s.grid_thw[0] * s.grid_thw[1] * s.grid_thw[2] for s in specs]
        out = torch.empty((sum(counts), patch_dim), dtype=torch.float32, device=flat.device)
        row = start = 0
        for spec, n in zip(specs, counts):
            normalize = self._normalizer(spec)
            width = patch_dim // spec.repeat
            sent, region = flat[start : start + n * width].view(n, width), out[row : row + n]
            if spec.repeat == 1:
                normalize.rows_(region.copy_(sent))
            else:  # normalized once, then copied over the temporal patch
                repeat_rows(normalize.rows_(sent.to(torch.float32)), normalize.channels, spec.repeat, region)
            start, row = start + n * width, row + n
        return out.to(self.dtype)

    def _normalizer(self, spec: EncodeSpec) -> PixelNormalize:
        """The PixelNormalize of `spec`'s levels, built (and checked against its table) once per settings."""
        if spec.levels is None:
            raise RuntimeError("uint8 rows without the levels that normalize them")
        normalize = self._normalizers.get(spec.levels)
        if normalize is None:
            normalize = self._normalizers[spec.levels] = PixelNormalize(*msgspec.structs.astuple(spec.levels))
        return normalize
