"""Tensor-parallel towers of Qwen2.5-Omni's thinker (its chunked Whisper-style audio tower and its Qwen2.5-VL vision
tower, heads and MLP split over ranks), equal to transformers' `get_audio_features`, `get_image_features` and
`get_video_features`; Qwen2_5OmniTowerEncoder serves them to Eric's generic path."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.common.widths import embedding_width
from eric_epd.models.crop_tower import ShardedTower, TowerEncoder, check_tower_tp
from eric_epd.models.layers.attention import VarlenPlan
from eric_epd.models.layers.config import IGNORED_SUFFIXES, config_to_dict
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.qwen2_5_vl import Qwen2_5_VLVisionEncoder
from eric_epd.models.qwen2_audio import (
    LAYER_NORM_EPS,
    WhisperEncoderLayer,
    pooled_pairs,
    whisper_output_lengths,
    without_key_bias,
)
from eric_epd.models.qwen2_vl import Qwen2VLVisionEncoder

logger = logging.getLogger(__name__)

WEIGHT_PREFIXES: tuple[str, ...] = ("thinker.audio_tower.", "thinker.visual.")
"""Checkpoint names of the thinker's two towers (released names); the language model, talker and token2wav are never
read."""
AUDIO_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "activation_function": "gelu",
        "max_source_positions": 1500,
        "n_window": 100,
        "output_dim": 3584,
    }
)
"""transformers' Qwen2_5OmniAudioEncoderConfig defaults, for keys a checkpoint's audio_config leaves out (the vision
tower's equal Qwen2.5-VL's, which Qwen2_5_VLVisionEncoder keeps)."""
UNUSED_KEYS = frozenset({"audio_tower.audio_bos_eos_token.weight"})
"""Tower tensors no feature depends on (the thinker's forward never reads them)."""
VISION_INPUTS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
)
"""Per vision modality, the processor's (patches, grid) tensors."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's parameter name: `thinker.` dropped, the vision attention's separate
    `q`, `k`, `v` named as the fused qkv's parts (`q_proj`, ...: crop_tower.QKV_PARTS)."""
    key = name.removeprefix("thinker.")
    if key.startswith("audio_tower."):
        return key
    if key.startswith("visual."):
        head, _, leaf = key.rpartition(".")
        owner, _, proj = head.rpartition(".")
        return f"{owner}.{proj}_proj.{leaf}" if owner.endswith(".attn") and proj in ("q", "k", "v") else key
    raise KeyError(f"{name!r} is not a Qwen2.5-Omni audio or vision tower weight")


def chunk_lengths(mel_lengths: list[int], n_window: int) -> list[int]:
    """Each clip's mel frames cut into chunks of 2 * n_window (the last one shorter), clips in order, as
    transformers' `chunk_and_pad_features` cuts them."""
    size = 2 * n_window
    chunks: list[int] = []
    for length in mel_lengths:
        chunks.extend([size] * (length // size) + ([length % size] if length % size else []))
    return chunks


def fill_sinusoids(table: torch.Tensor, embedding: Any) -> None:
    """`table` ((positions, dim), a buffer) filled with the sinusoids transformers' `embedding` class (a family's
    SinusoidsPositionEmbedding) computes for that shape, in float32 on the CPU."""
    length, dim = table.shape
    with torch.device("cpu"):
        values = embedding(length, dim).positional_embedding
    table.copy_(values)


class ChunkedWhisperEncoder(nn.Module):
    """Qwen2.5-Omni's audio tower (parameter names follow the checkpoint's `audio_tower.*`): each clip cut into chunks
    of 2 * n_window mel frames; per chunk the two GELU convolutions (the second of stride 2; conv1's output zero past
    the chunk) and the sinusoidal positions from 0, replicated; Whisper layers (qwen2_audio.WhisperEncoderLayer: heads
    and FFN split over ranks) attending within each chunk; the 2-wide average pool over each clip's positions,
    `ln_post` and `proj`, replicated."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim = int(cfg["d_model"])
        self.n_window = int(cfg["n_window"])
        self.conv1 = nn.Conv1d(int(cfg["num_mel_bins"]), dim, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.register_buffer(
            "positional_embedding", torch.empty(int(cfg["max_source_positions"]), dim), persistent=False
        )  # computed, not read: fill_positions
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, tp, dtype) for _ in range(int(cfg["encoder_layers"])))
        self.ln_post = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.proj = nn.Linear(dim, int(cfg["output_dim"]), dtype=dtype)

    def fill_positions(self) -> None:
        """The positional table, as transformers' SinusoidsPositionEmbedding computes it (float32)."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import SinusoidsPositionEmbedding

        fill_sinusoids(self.positional_embedding, SinusoidsPositionEmbedding)

    def embedded(self, features: torch.Tensor, chunks: list[int]) -> torch.Tensor:
        """(frames of every clip, mel bins) -> (chunks, positions, dim): each chunk convolved on its own (zero past
        its end), its positions numbered from 0."""
        padded = nn.utils.rnn.pad_sequence(list(features.split(chunks)), batch_first=True).transpose(1, 2)
        lengths = torch.tensor(chunks, device=features.device)
        inside = (torch.arange(padded.shape[2], device=features.device)[None, :] < lengths[:, None])[:, None, :]
        hidden = F.gelu(self.conv2(F.gelu(self.conv1(padded)) * inside)).transpose(1, 2)
        if hidden.shape[1] > self.positional_embedding.shape[0]:
            raise ValueError(
                f"chunks of {max(chunks)} mel frames give {hidden.shape[1]} positions; the tower has "
                f"{self.positional_embedding.shape[0]}"
            )
        return hidden + self.positional_embedding[: hidden.shape[1]].to(hidden.dtype)

    def forward(self, features: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        """(frames of every clip one after another, mel bins), each clip's frames -> (sum of its rows, output_dim):
        only each chunk's valid positions run the layers (packed, attending within their chunk) and only the pool
        pairs each clip keeps are pooled."""
        mel_lengths = mel_lengths.cpu()
        chunks = chunk_lengths(mel_lengths.tolist(), self.n_window)
        hidden = self.embedded(features, chunks)
        after_conv = (torch.tensor(chunks) - 1) // 2 + 1
        valid = torch.arange(hidden.shape[1])[None, :] < after_conv[:, None]
        packed = hidden[valid.to(hidden.device)]  # (sum of positions, dim), chunks in order
        plan = VarlenPlan.build([0, *torch.cumsum(after_conv, 0).tolist()], packed.device)
        for layer in self.layers:
            packed = layer(packed, plan)
        positions, rows = whisper_output_lengths(mel_lengths)  # a clip's chunks' positions add up to its own
        return self.proj(self.ln_post(pooled_pairs(packed, positions, rows)))


class OmniTowers(ShardedTower):
    """An Omni thinker's audio tower (`audio_tower`) and vision tower (`visual`), this rank's shard of each. `audio` and
    `vision` give every item's rows, items in order, identical (replicated) on every tensor-parallel rank. A subclass
    builds both towers (the audio one with `fill_positions`), sets `mel_bins` and says how many rows a clip gives
    (`audio_rows`)."""

    audio_tower: nn.Module
    visual: Qwen2VLVisionEncoder
    mel_bins: int
    """Log-mel bins per frame the audio tower takes."""

    def audio_rows(self, mel_lengths: torch.Tensor) -> list[int]:
        """Rows each clip of `mel_lengths` valid log-mel frames gives (its audio tokens)."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """ShardedTower.load_weights, then the audio tower's positional table computed and the vision tower's
        after-load rewrites run."""
        loaded = super().load_weights(weights)
        self.audio_tower.fill_positions()
        for module in self.visual.modules():
            if (after_load := getattr(module, "after_load", None)) is not None:
                after_load()
        return loaded

    @torch.inference_mode()
    def audio(self, input_features: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        """Every clip's rows from its valid log-mel frames ((frames of every clip, mel bins), clips one after
        another), as `get_audio_features` gives them."""
        if input_features.dim() != 2 or input_features.shape[1] != self.mel_bins:
            raise ValueError(
                f"input_features of shape {list(input_features.shape)}; expected [frames, {self.mel_bins}]"
            )
        if int(mel_lengths.sum()) != input_features.shape[0]:
            raise ValueError(f"{input_features.shape[0]} mel frames for clips of {mel_lengths.tolist()}")
        if input_features.shape[0] == 0:
            return torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        return self.audio_tower(input_features.to(device=self.device, dtype=self.dtype), mel_lengths)

    def vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Every image's (video's) merged patches, items in order, as `get_image_features` (`get_video_features`)
        gives them (Qwen3-Omni's: each with its DeepStack levels beside it)."""
        return self.visual(pixels, grid_thw)


class Qwen2_5OmniTowers(OmniTowers):  # noqa: N801 - HF naming
    """Qwen2.5-Omni's thinker towers: the chunked Whisper-style audio tower and Eric's Qwen2.5-VL vision tower."""

    model_type: ClassVar[str] = "qwen2_5_omni"
    family: ClassVar[str] = "Qwen2.5-Omni"
    weight_prefixes: ClassVar[tuple[str, ...]] = WEIGHT_PREFIXES
    checkpoint_key = staticmethod(checkpoint_key)

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp)
        full = config_to_dict(config)
        thinker = config_to_dict(full.get("thinker_config") or {})
        audio = {**AUDIO_DEFAULTS, **config_to_dict(thinker.get("audio_config") or {})}
        vision = config_to_dict(thinker.get("vision_config") or {})
        self.width = embedding_width(full)
        self.mel_bins = int(audio["num_mel_bins"])
        self.audio_tower = ChunkedWhisperEncoder(audio, self.tp, dtype)
        self.visual = Qwen2_5_VLVisionEncoder(vision, self.tp, dtype)
        widths = {"audio output_dim": int(audio["output_dim"]), "vision out_hidden_size": self.visual.out_dim}
        if any(w != self.width for w in widths.values()):
            raise ValueError(f"the towers' widths {widths} differ from the language model's {self.width}")

    def skipped(self, key: str) -> bool:
        """The audio tower's bos/eos embedding (no feature reads it) and non-persistent buffers some exports hold."""
        return key in UNUSED_KEYS or key.endswith(IGNORED_SUFFIXES)

    def expected_keys(self) -> set[str]:
        """Every tensor the checkpoint must provide: no audio k_proj bias (Whisper has none); the positional table is
        a buffer, computed."""
        return {
            key
            for key in super().expected_keys()
            if not (key.startswith("audio_tower.") and key.endswith(".k_proj.bias"))
        }

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """OmniTowers.load_weights, an audio k_proj bias refused; then k's part of each audio layer's fused bias
        zeroed."""
        loaded = super().load_weights(without_key_bias(weights))
        for layer in self.audio_tower.layers:
            layer.self_attn.zero_key_bias()
        return loaded

    def audio_rows(self, mel_lengths: torch.Tensor) -> list[int]:
        """Rows per clip: the 2-wide pool's over the stride-2 convolution's positions."""
        return whisper_output_lengths(mel_lengths)[1].tolist()


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless both towers of `config` (a config.json) split over `tp` ranks
    (attention heads, FFN and MLP widths divide by it); they are built on the meta device, nothing allocated."""
    check_tower_tp(Qwen2_5OmniTowers, config, tp)


class Qwen2_5OmniTowerEncoder(TowerEncoder):  # noqa: N801 - HF naming
    """An Omni thinker's towers (OmniTowers: Qwen2.5-Omni's here) behind the generic path's encoder interface: a batch
    of one modality's joined processor tensors in (audio: `input_features` and `audio_feature_lengths`; images:
    `pixel_values` and `image_grid_thw`; videos: `pixel_values_videos` and `video_grid_thw`), each item's rows out."""

    tower_class = Qwen2_5OmniTowers

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "image") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch of one modality whose tensors hold the items one after
        another along dim 0; each item must give the rows its spec says."""
        if modality == "audio":
            names = ("input_features", "audio_feature_lengths")
        elif modality in VISION_INPUTS:
            names = VISION_INPUTS[modality]
        else:
            raise RuntimeError(f"the {self.tower.family} towers encode audio, images and videos, not {modality}")
        missing = set(names) - set(inputs)
        if missing:
            raise RuntimeError(f"a {modality} batch needs {sorted(missing)}; it has {sorted(inputs)}")
        if modality == "audio":
            lengths = inputs["audio_feature_lengths"].reshape(-1).long()
            expected = self.tower.audio_rows(lengths)
        else:
            expected = self.tower.visual.num_tokens(inputs[names[1]])
        if expected != list(rows):
            raise RuntimeError(f"the items' {modality} tensors give {expected} rows, their specs say {list(rows)}")
        if modality == "audio":
            flat = self.tower.audio(inputs["input_features"], lengths)
        else:
            flat = self.tower.vision(inputs[names[0]], inputs[names[1]])
        return list(flat.split(rows))


ENCODER = Qwen2_5OmniTowerEncoder
"""The encoder GenericWorkload loads for this family (facts.GENERIC_TOWERS)."""
