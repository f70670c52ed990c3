"""An audio-only transformers model as Eric's encoder: the checkpoint's own audio tower and projector (the language
model never built), a batch of feature-extractor outputs in, each item's rows out."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from eric_epd.models.hf.base import HFEncoder

logger = logging.getLogger(__name__)


def whisper_frames_needed(mel_lengths: torch.Tensor, mel_frames: int) -> int:
    """Mel frames a Whisper-style tower (two 3-wide convolutions, the second of stride 2, then a 2-wide average pool)
    must see for every item's valid outputs to equal the full-length forward's: each item's frames and the two after
    them (the convolutions' reach), rounded up to the pool's alignment of 4, at most the padded length."""
    needed = int(mel_lengths.max()) + 2
    return min(mel_frames, -(-needed // 4) * 4)


def trimmed_whisper_tower(tower: nn.Module, features: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
    """`Qwen2AudioEncoder.forward` (transformers 5.19) on features cut to fewer than its fixed 3000 frames, which its
    forward refuses: the same modules in the same order, the positional table cut alike. Padding past every item's
    end attends to nothing valid and is never kept, so the valid rows equal the full forward's at a fraction of its
    work (a 5 s clip is a sixth of the frames and a thirty-sixth of the attention)."""
    hidden = nn.functional.gelu(tower.conv1(features))
    hidden = nn.functional.gelu(tower.conv2(hidden)).permute(0, 2, 1)
    hidden = hidden + tower.embed_positions.weight[: hidden.shape[1]]
    for layer in tower.layers:
        hidden = layer(hidden, attention)
    hidden = tower.avg_pooler(hidden.permute(0, 2, 1)).permute(0, 2, 1)
    return tower.layer_norm(hidden)


def qwen2_audio_rows(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Qwen2-Audio's audio rows for a batch, items in order: what `Qwen2AudioModel.forward` (transformers 5.19, which
    has no `get_audio_features` for it) scatters into the audio tokens' positions. The tower attends only within each
    item's length after its stride-2 convolution, the projector maps every position, and each item keeps the first
    `_get_feat_extract_output_lengths` rows (one per audio token). Unlike transformers and vLLM, the tower runs only
    over the frames the batch's longest item needs (`whisper_frames_needed`), not the 30 s every clip is padded to."""
    from transformers.masking_utils import create_bidirectional_mask

    inner = model.model
    tower = inner.audio_tower
    mel_lengths = inputs["feature_attention_mask"].sum(-1)
    feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(mel_lengths)
    frames = whisper_frames_needed(mel_lengths, inputs["input_features"].shape[-1])
    features = inputs["input_features"][..., :frames].to(tower.conv1.weight.dtype)
    batch, positions = features.shape[0], (frames - 1) // 2 + 1
    seq = torch.arange(positions, dtype=feat_lengths.dtype, device=feat_lengths.device)
    valid = (seq[None, :] < feat_lengths[:, None]).to(torch.long)
    attention = create_bidirectional_mask(
        config=tower.config,
        attention_mask=valid,
        inputs_embeds=torch.zeros((batch, positions, 1), dtype=features.dtype, device=features.device),
    )
    projected = inner.multi_modal_projector(trimmed_whisper_tower(tower, features, attention))
    lengths = out_lengths.to(projected.device)
    return projected[torch.arange(projected.shape[1], device=projected.device)[None, :] < lengths[:, None]]


def qwen2_5_omni_audio_rows(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Qwen2.5-Omni's thinker: `get_audio_features` on the batch's clips (models/hf/audio.valid_frames: each clip's
    valid log-mel frames, one after another) padded back to the longest clip and masked, as the processor pads and
    masks them (the tower reads only the masked frames, chunk by chunk within each clip); its rows, items in order,
    are what the thinker's forward scatters into the audio tokens' positions. Qwen3-Omni's thinker takes the same
    call (its `get_audio_features` drops `audio_feature_lengths` given alone, so the mask is always passed)."""
    frames, lengths = inputs["input_features"], inputs["audio_feature_lengths"].reshape(-1)
    mask = torch.arange(int(lengths.max()), device=frames.device)[None, :] < lengths[:, None]
    padded = frames.new_zeros((*mask.shape, frames.shape[-1]))
    padded[mask] = frames
    out = model.get_audio_features(padded.transpose(1, 2), feature_attention_mask=mask.to(torch.long), return_dict=True)
    return out.last_hidden_state


AUDIO_ROWS: Mapping[str, Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]] = MappingProxyType(
    {
        "qwen2_audio": qwen2_audio_rows,
        "qwen2_5_omni": qwen2_5_omni_audio_rows,
        "qwen3_omni_moe": qwen2_5_omni_audio_rows,  # the same call (the mask always passed: see the docstring)
    }
)
"""HF model_type -> (model, a batch's feature tensors) -> the batch's rows, items in order."""


class HFAudioEncoder(HFEncoder):
    """The model's audio tower and projector on named feature tensors, its output laid out as vLLM's rows."""

    def __init__(self, model: nn.Module, model_type: str, width: int, dtype: torch.dtype) -> None:
        if model_type not in AUDIO_ROWS:
            raise ValueError(
                f"model_type {model_type!r} has no audio rows in Eric; those that do: {', '.join(sorted(AUDIO_ROWS))}"
            )
        super().__init__(model, model_type, width, dtype)
        self.rows = AUDIO_ROWS[model_type]

    def encode(self, inputs: dict[str, torch.Tensor], rows: list[int], modality: str = "audio") -> list[torch.Tensor]:
        """Each item's [rows, width] output, for a batch of audio items whose tensors hold them one after another
        along dim 0; floating inputs are cast to the model's dtype (integer masks travel in their own)."""
        if modality != "audio":
            raise RuntimeError(f"this encoder takes audio, not {modality}")
        tensors = {name: t.to(self.dtype) if t.is_floating_point() else t for name, t in inputs.items()}
        with torch.no_grad():
            flat = self.rows(self.model, tensors)
        return self.split_rows(flat, rows)
