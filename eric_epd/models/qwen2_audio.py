"""Tensor-parallel Qwen2-Audio audio tower (Whisper-style encoder, heads and FFN split over ranks) and its linear
projector, equal to the rows transformers' Qwen2-Audio scatters into its audio tokens; Qwen2AudioTowerEncoder serves
it to Eric's generic path."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.common.widths import embedding_width
from eric_epd.models.crop_tower import ShardedTower, TowerEncoder, check_tower_tp
from eric_epd.models.hf.audio_encoder import whisper_frames_needed
from eric_epd.models.layers.activations import get_activation
from eric_epd.models.layers.attention import VarlenPlan, varlen_attention
from eric_epd.models.layers.config import config_to_dict
from eric_epd.models.layers.parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, TPContext

logger = logging.getLogger(__name__)

WEIGHT_PREFIXES: tuple[str, ...] = (
    "audio_tower.",
    "multi_modal_projector.",
    "model.audio_tower.",
    "model.multi_modal_projector.",
)
"""Checkpoint names of the tower and projector: released (`audio_tower.*`) and with transformers 5's `model.` level;
the language model's are never read."""
ENCODER_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "activation_function": "gelu",
        "max_source_positions": 1500,
    }
)
"""transformers' Qwen2AudioEncoderConfig defaults, for keys a checkpoint's audio_config leaves out."""
LAYER_NORM_EPS = 1e-5
"""Whisper's layer norms keep torch's default epsilon."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's parameter name: transformers 5's `model.` level dropped."""
    name = name.removeprefix("model.")
    if name.startswith(("audio_tower.", "multi_modal_projector.")):
        return name
    raise KeyError(f"{name!r} is not a Qwen2-Audio audio tower or projector weight")


def whisper_output_lengths(mel_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions after the stride-2 convolution, rows after the 2-wide pool) per item of `mel_lengths` valid mel
    frames: `Qwen2AudioEncoder._get_feat_extract_output_lengths` (transformers 5.19)."""
    positions = (mel_lengths - 1) // 2 + 1
    return positions, (positions - 2) // 2 + 1


def pooled_pairs(packed: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The 2-wide average pool (stride 2) over each item's packed positions (`positions` of them per item, items one
    after another in `packed`), only the first `rows` pairs of each item computed: (sum of rows, dim)."""
    starts = torch.cumsum(positions, 0) - positions
    kept = torch.cat([torch.arange(s, s + 2 * r) for s, r in zip(starts.tolist(), rows.tolist())])
    return packed[kept.to(packed.device)].view(-1, 2, packed.shape[1]).mean(1)


class WhisperAttention(nn.Module):
    """Self-attention within each item: q, k and v fused and split by heads (Whisper's k_proj has no bias: its part
    of the fused bias stays zero), out_proj row-parallel (all-reduced)."""

    def __init__(self, dim: int, num_heads: int, tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"audio width {dim} not divisible by {num_heads} heads")
        self.qkv = QKVParallelLinear(dim, num_heads, True, tp, dtype)
        self.out_proj = RowParallelLinear(dim, dim, True, tp, dtype)
        self.heads, self.head_dim = self.qkv.num_heads_local, dim // num_heads
        self.scaling = self.head_dim**-0.5

    def zero_key_bias(self) -> None:
        """Zero k's part of the fused bias (the checkpoint has none to load)."""
        with torch.no_grad():
            self.qkv.bias.narrow(0, self.qkv.local, self.qkv.local).zero_()

    def forward(self, x: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """(N, dim) packed positions -> (N, dim): this rank's heads within each item, summed over ranks; q is scaled
        before attention, as transformers does."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        out = varlen_attention(q * self.scaling, k, v, plan, scale=1.0)
        return self.out_proj(out.reshape(x.shape[0], self.heads * self.head_dim))


class WhisperEncoderLayer(nn.Module):
    """Pre-LN block: x + self_attn(self_attn_layer_norm(x)); x + fc2(act(fc1(final_layer_norm(x)))) (fc1 column-,
    fc2 row-parallel)."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim, ffn = int(cfg["d_model"]), int(cfg["encoder_ffn_dim"])
        self.self_attn_layer_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.self_attn = WhisperAttention(dim, int(cfg["encoder_attention_heads"]), tp, dtype)
        self.final_layer_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.fc1 = ColumnParallelLinear(dim, ffn, True, tp, dtype)
        self.fc2 = RowParallelLinear(ffn, dim, True, tp, dtype)
        self.act = get_activation(str(cfg["activation_function"]))

    def forward(self, x: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
        """One block over (N, dim) packed positions."""
        x = x + self.self_attn(self.self_attn_layer_norm(x), plan)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Qwen2-Audio's audio tower (parameter names follow the checkpoint's `audio_tower.*`): two GELU convolutions
    (the second of stride 2) and the positional table, replicated; the layers split over ranks; the 2-wide average
    pool and the final layer norm."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim = int(cfg["d_model"])
        self.conv1 = nn.Conv1d(int(cfg["num_mel_bins"]), dim, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(int(cfg["max_source_positions"]), dim, dtype=dtype)
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, tp, dtype) for _ in range(int(cfg["encoder_layers"])))
        self.layer_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, dtype=dtype)

    def embedded(self, features: torch.Tensor) -> torch.Tensor:
        """(B, mel bins, frames) -> (B, positions, dim): the convolutions and the positional table."""
        hidden = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        if hidden.shape[1] > self.embed_positions.num_embeddings:
            raise ValueError(
                f"{features.shape[-1]} mel frames give {hidden.shape[1]} positions; the tower has "
                f"{self.embed_positions.num_embeddings}"
            )
        return hidden + self.embed_positions.weight[: hidden.shape[1]]

    def forward(self, features: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        """(B, mel bins, frames) features, each item's valid mel frames -> (sum of its rows, dim): only each item's
        valid positions run the layers (packed, attending within their item), and only the pool pairs its rows keep
        are pooled, so padding is never computed past the convolutions."""
        positions, rows = whisper_output_lengths(mel_lengths.cpu())
        hidden = self.embedded(features)
        valid = torch.arange(hidden.shape[1])[None, :] < positions[:, None]
        packed = hidden[valid.to(hidden.device)]  # (sum of positions, dim), items in order
        plan = VarlenPlan.build([0, *torch.cumsum(positions, 0).tolist()], packed.device)
        for layer in self.layers:
            packed = layer(packed, plan)
        return self.layer_norm(pooled_pairs(packed, positions, rows))


class Qwen2AudioProjector(nn.Module):
    """The linear map from the tower's width to the language model's (replicated)."""

    def __init__(self, dim: int, width: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, dim) -> (N, width)."""
        return self.linear(x)


class Qwen2AudioTower(ShardedTower):
    """Qwen2-Audio's audio tower and projector. forward(input_features (B, mel bins, frames), the items' valid mel
    frames) -> (rows of every item, width), items in order, identical (replicated) on every tensor-parallel rank.
    The tower sees only the frames the batch's longest item needs (`whisper_frames_needed`)."""

    model_type: ClassVar[str] = "qwen2_audio"
    family: ClassVar[str] = "Qwen2-Audio"
    weight_prefixes: ClassVar[tuple[str, ...]] = WEIGHT_PREFIXES
    checkpoint_key = staticmethod(checkpoint_key)

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp)
        full = config_to_dict(config)
        cfg = {**ENCODER_DEFAULTS, **config_to_dict(full.get("audio_config") or {})}
        self.mel_bins = int(cfg["num_mel_bins"])
        self.width = embedding_width(full)
        self.audio_tower = WhisperEncoder(cfg, self.tp, dtype)
        self.multi_modal_projector = Qwen2AudioProjector(int(cfg["d_model"]), self.width, dtype)

    def expected_keys(self) -> set[str]:
        """Every tensor the checkpoint must provide: no k_proj bias (Whisper has none)."""
        return {key for key in super().expected_keys() if not key.endswith(".k_proj.bias")}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """ShardedTower.load_weights, a k_proj bias refused (the tower would drop it), then k's bias part zeroed."""
        loaded = super().load_weights(without_key_bias(weights))
        for layer in self.audio_tower.layers:
            layer.self_attn.zero_key_bias()
        return loaded

    @torch.inference_mode()
    def forward(self, input_features: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        """Every item's rows, items in order: the first `whisper_output_lengths` rows of each item's projected
        features, as Qwen2-Audio's forward scatters them into its audio tokens."""
        if input_features.dim() != 3 or input_features.shape[1] != self.mel_bins:
            raise ValueError(
                f"input_features of shape {list(input_features.shape)}; expected [items, {self.mel_bins}, frames]"
            )
        if input_features.shape[0] == 0:
            return torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        frames = whisper_frames_needed(mel_lengths, input_features.shape[-1])
        features = input_features[..., :frames].to(device=self.device, dtype=self.dtype)
        return self.multi_modal_projector(self.audio_tower(features, mel_lengths))


def without_key_bias(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The weights, a KeyError for a Whisper layer's k_proj bias (it has none, so the tower would compute without it;
    Qwen2.5-Omni's audio tower too)."""
    for name, src in weights:
        if name.endswith(".self_attn.k_proj.bias"):
            raise KeyError(f"unexpected weight {name!r}: Whisper's k_proj has no bias")
        yield name, src


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless the tower of `config` (a config.json) splits over `tp` ranks
    (its attention heads and FFN width divide by it); the tower is built on the meta device, nothing allocated."""
    check_tower_tp(Qwen2AudioTower, config, tp)


class Qwen2AudioTowerEncoder(TowerEncoder):
    """The tower behind the generic path's encoder interface: a batch of audio items' joined feature-extractor
    tensors (`input_features`, `feature_attention_mask`) in, each item's rows out."""

    tower_class = Qwen2AudioTower

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "audio") -> list[torch.Tensor]:
        """Each item's [rows, width] output for a batch whose tensors hold the items one after another along dim 0;
        each item must give the rows its spec says (the audio tokens the processor expanded)."""
        if modality != "audio":
            raise RuntimeError(f"the Qwen2-Audio tower encodes audio, not {modality}")
        missing = {"input_features", "feature_attention_mask"} - set(inputs)
        if missing:
            raise RuntimeError(f"an audio batch needs {sorted(missing)}; it has {sorted(inputs)}")
        mel_lengths = inputs["feature_attention_mask"].sum(-1).long()
        expected = whisper_output_lengths(mel_lengths)[1].tolist()
        if expected != list(rows):
            raise RuntimeError(f"the items' features give {expected} rows, their specs say {list(rows)}")
        return list(self.tower(inputs["input_features"], mel_lengths).split(rows))


ENCODER = Qwen2AudioTowerEncoder
"""The encoder GenericWorkload loads for this family (facts.GENERIC_TOWERS)."""
