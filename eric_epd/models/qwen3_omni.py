"""Tensor-parallel towers of Qwen3-Omni-MoE's thinker (its chunked Conv2d-stem audio tower and its Qwen3-VL vision
tower, heads and MLP split over ranks), equal to transformers' `get_audio_features`, `get_image_features` and
`get_video_features` (vision rows with their DeepStack levels beside them); Qwen3OmniTowerEncoder serves them."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from eric_epd.common.widths import embedding_width
from eric_epd.models.crop_tower import check_tower_tp
from eric_epd.models.layers.activations import get_activation
from eric_epd.models.layers.attention import VarlenPlan
from eric_epd.models.layers.config import IGNORED_SUFFIXES, config_to_dict
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.qwen2_5_omni import WEIGHT_PREFIXES, OmniTowers, Qwen2_5OmniTowerEncoder, fill_sinusoids
from eric_epd.models.qwen2_audio import LAYER_NORM_EPS, WhisperEncoderLayer
from eric_epd.models.qwen3_vl import Qwen3VLVisionEncoder

logger = logging.getLogger(__name__)

_DEEPSTACK = re.compile(r"^merger_list\.")
"""The thinker's DeepStack mergers (`visual.merger_list.N`), which Qwen3VLVisionEncoder names
`deepstack_merger_list.N` (transformers' own alias)."""


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor name as the tower's parameter name: `thinker.` dropped, the vision tower's names as
    Qwen3VLVisionEncoder's (`merger_list.N` as `deepstack_merger_list.N`, `mlp.linear_fcN` as `mlp.fcN`)."""
    key = name.removeprefix("thinker.")
    if key.startswith("audio_tower."):
        return key
    if key.startswith("visual."):
        return "visual." + Qwen3VLVisionEncoder.param_name(_DEEPSTACK.sub("deepstack_merger_list.", key[7:]))
    raise KeyError(f"{name!r} is not a Qwen3-Omni audio or vision tower weight")


def _modeling() -> Any:
    """transformers' Qwen3-Omni modeling module (imported on use: it imports the whole family)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe

    return modeling_qwen3_omni_moe


def thinker_tower_configs(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The thinker's (audio_config, vision_config) of a config.json, every key it leaves out at transformers' default
    (Qwen3OmniMoeAudioEncoderConfig's, Qwen3OmniMoeVisionEncoderConfig's)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
        Qwen3OmniMoeVisionEncoderConfig,
    )

    thinker = config_to_dict(config.get("thinker_config") or {})
    audio = {**Qwen3OmniMoeAudioEncoderConfig().to_dict(), **config_to_dict(thinker.get("audio_config") or {})}
    vision = {**Qwen3OmniMoeVisionEncoderConfig().to_dict(), **config_to_dict(thinker.get("vision_config") or {})}
    return audio, vision


class Qwen3OmniAudioEncoder(nn.Module):
    """Qwen3-Omni's audio tower (parameter names follow the checkpoint's `audio_tower.*`). Each clip is cut into
    chunks of 2 * n_window mel frames and every chunk zero-padded to the batch's longest (transformers'
    `chunk_and_pad_features`: the padding reaches a short chunk's last rows through the convolutions, as in
    transformers and vLLM); per chunk three GELU Conv2d (stride 2 over mel bins and time), `conv_out` and the
    sinusoidal positions from 0, replicated; Whisper layers (qwen2_audio.WhisperEncoderLayer: heads and FFN split
    over ranks) over each chunk's valid positions, attending within windows of n_window_infer frames of a clip;
    `ln_post`, `proj1`, the activation and `proj2`, replicated."""

    def __init__(self, cfg: Mapping[str, Any], tp: TPContext, dtype: torch.dtype | None) -> None:
        super().__init__()
        dim, width, mels = int(cfg["d_model"]), int(cfg["downsample_hidden_size"]), int(cfg["num_mel_bins"])
        self.n_window, self.n_window_infer = int(cfg["n_window"]), int(cfg["n_window_infer"])
        self.conv_chunksize = int(cfg["conv_chunksize"])
        self.conv2d1 = nn.Conv2d(1, width, 3, 2, padding=1, dtype=dtype)
        self.conv2d2 = nn.Conv2d(width, width, 3, 2, padding=1, dtype=dtype)
        self.conv2d3 = nn.Conv2d(width, width, 3, 2, padding=1, dtype=dtype)
        self.conv_out = nn.Linear(width * ((((mels + 1) // 2 + 1) // 2 + 1) // 2), dim, bias=False, dtype=dtype)
        self.register_buffer(
            "positional_embedding", torch.empty(int(cfg["max_source_positions"]), dim), persistent=False
        )  # computed, not read: fill_positions
        self.layers = nn.ModuleList(WhisperEncoderLayer(cfg, tp, dtype) for _ in range(int(cfg["encoder_layers"])))
        self.ln_post = nn.LayerNorm(dim, eps=LAYER_NORM_EPS, dtype=dtype)
        self.proj1 = nn.Linear(dim, dim, dtype=dtype)
        self.act = get_activation(str(cfg["activation_function"]))
        self.proj2 = nn.Linear(dim, int(cfg["output_dim"]), dtype=dtype)

    def fill_positions(self) -> None:
        """The positional table, as transformers' SinusoidsPositionEmbedding computes it (float32)."""
        fill_sinusoids(self.positional_embedding, _modeling().SinusoidsPositionEmbedding)

    def embedded(self, padded: torch.Tensor) -> torch.Tensor:
        """(chunks, mel bins, frames) padded chunks -> (chunks, positions, dim): the convolutions (`conv_chunksize`
        chunks at a time, as transformers runs them), each position's channels x mel rows through `conv_out`, the
        positions numbered from 0."""
        parts = []
        for chunk in padded.unsqueeze(1).split(self.conv_chunksize):
            hidden = F.gelu(self.conv2d1(chunk))
            hidden = F.gelu(self.conv2d2(hidden))
            parts.append(F.gelu(self.conv2d3(hidden)))
        hidden = torch.cat(parts)
        chunks, channels, mels, positions = hidden.shape
        if positions > self.positional_embedding.shape[0]:
            raise ValueError(
                f"chunks of {padded.shape[-1]} mel frames give {positions} positions; the tower has "
                f"{self.positional_embedding.shape[0]}"
            )
        hidden = self.conv_out(hidden.permute(0, 3, 1, 2).reshape(chunks, positions, channels * mels))
        return hidden + self.positional_embedding[:positions].to(hidden.dtype)

    def forward(self, features: torch.Tensor, mel_lengths: torch.Tensor) -> torch.Tensor:
        """(frames of every clip one after another, mel bins), each clip's frames -> (sum of its rows, output_dim):
        chunks, valid positions and attention windows as transformers' own helpers lay them out; only the valid
        positions run the layers (packed)."""
        hf = _modeling()
        lengths = mel_lengths.cpu()
        padded, chunks = hf.chunk_and_pad_features(features.T, lengths, self.n_window)
        hidden = self.embedded(padded)
        valid = hf.get_valid_indices(chunks, self.n_window).to(hidden.device)
        packed = hidden.reshape(-1, hidden.shape[-1])[valid]  # (sum of positions, dim), chunks in order
        windows = hf.get_audio_cu_seqlens(chunks, lengths, self.n_window_infer, self.n_window)
        plan = VarlenPlan.build(windows, packed.device)
        for layer in self.layers:
            packed = layer(packed, plan)
        return self.proj2(self.act(self.proj1(self.ln_post(packed))))


class Qwen3OmniTowers(OmniTowers):
    """Qwen3-Omni's thinker towers: the Conv2d-stem audio tower above and Eric's Qwen3-VL vision tower (its rows
    [merged | level 1 | ... | level k], as vLLM's qwen3_omni_moe_thinker and SGLang lay them out); `width` is the
    audio rows', the language model's hidden size."""

    model_type: ClassVar[str] = "qwen3_omni_moe"
    family: ClassVar[str] = "Qwen3-Omni"
    weight_prefixes: ClassVar[tuple[str, ...]] = WEIGHT_PREFIXES
    checkpoint_key = staticmethod(checkpoint_key)

    def __init__(self, config: Any, tp: TPContext | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(tp)
        full = config_to_dict(config)
        audio, vision = thinker_tower_configs(full)
        self.width = embedding_width(full, "audio")
        self.mel_bins = int(audio["num_mel_bins"])
        self.n_window = int(audio["n_window"])
        self.audio_tower = Qwen3OmniAudioEncoder(audio, self.tp, dtype)
        self.visual = Qwen3VLVisionEncoder(vision, self.tp, dtype)
        widths = {"audio output_dim": int(audio["output_dim"]), "vision out_hidden_size": self.visual.out_dim}
        if any(w != self.width for w in widths.values()):
            raise ValueError(f"the towers' widths {widths} differ from the language model's {self.width}")
        if self.visual.out_width != embedding_width(full, "image"):
            raise ValueError(
                f"vision rows of {self.visual.out_width} values; the checkpoint's are {embedding_width(full, 'image')}"
            )

    def skipped(self, key: str) -> bool:
        """Non-persistent buffers some exports hold."""
        return key.endswith(IGNORED_SUFFIXES)

    def expected_keys(self) -> set[str]:
        """Every tensor the checkpoint must provide: the audio layers' separate q, k and v (biases included), the
        vision blocks' fused qkv as it is; the positional table is a buffer, computed."""
        audio = {key for key in super().expected_keys() if key.startswith("audio_tower.")}
        return audio | {name for name, _ in self.visual.named_parameters(prefix="visual")}

    def audio_rows(self, mel_lengths: torch.Tensor) -> list[int]:
        """Rows per clip: transformers' `_get_feat_extract_output_lengths` (13 per full chunk, the tail's after
        three stride-2 convolutions)."""
        return _modeling()._get_feat_extract_output_lengths(mel_lengths, self.n_window).tolist()


def check_tp(config: Mapping[str, Any], tp: int) -> None:
    """ValueError, before any process starts, unless both towers of `config` (a config.json) split over `tp` ranks
    (attention heads, FFN and MLP widths divide by it); they are built on the meta device, nothing allocated."""
    check_tower_tp(Qwen3OmniTowers, config, tp)


class Qwen3OmniTowerEncoder(Qwen2_5OmniTowerEncoder):
    """Qwen3-Omni's towers behind the generic path's encoder interface (the same tensors in as Qwen2.5-Omni's)."""

    tower_class = Qwen3OmniTowers


ENCODER = Qwen3OmniTowerEncoder
"""The encoder GenericWorkload loads for this family (facts.GENERIC_TOWERS)."""
