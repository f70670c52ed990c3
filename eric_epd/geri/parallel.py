"""Tensor parallelism for Qwen-Image's diffusers transformer: each block's attention projections and feed-forwards
are split over the ranks by heads (column-parallel in, row-parallel out, one all-reduce each); diffusers' attention
processor already derives its head count from the projections' width, so it runs unchanged on a rank's heads."""

from __future__ import annotations

import torch
from torch import nn

from eric_epd.models.layers.parallel import ColumnParallelLinear, RowParallelLinear, TPContext

_COLUMNS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


def _split(linear: nn.Linear, kind: type[ColumnParallelLinear] | type[RowParallelLinear], tp: TPContext) -> nn.Module:
    """This rank's shard of `linear` as a parallel layer of `kind`, weights copied from the full layer."""
    part = kind(linear.in_features, linear.out_features, linear.bias is not None, tp, linear.weight.dtype)
    part.to(linear.weight.device)
    part.weight_loader(part.weight, linear.weight.detach())
    if linear.bias is not None:
        part.weight_loader(part.bias, linear.bias.detach())
    return part


def shard_qwen_image_transformer(transformer: nn.Module, tp: TPContext) -> None:
    """Replace each block's attention and MLP linears by this rank's shards, in place (no-op at world size 1).
    Heads must divide evenly: a ValueError names the numbers otherwise."""
    if tp.world_size == 1:
        return
    heads = transformer.config.num_attention_heads
    if heads % tp.world_size:
        raise ValueError(
            f"Qwen-Image's {heads} attention heads do not split over tensor-parallel size "
            f"{tp.world_size}; choose a --tp that divides {heads}"
        )
    for block in transformer.transformer_blocks:
        attn = block.attn
        for name in _COLUMNS:
            setattr(attn, name, _split(getattr(attn, name), ColumnParallelLinear, tp))
        attn.to_out[0] = _split(attn.to_out[0], RowParallelLinear, tp)
        attn.to_add_out = _split(attn.to_add_out, RowParallelLinear, tp)
        for mlp in (block.img_mlp, block.txt_mlp):
            mlp.net[0].proj = _split(mlp.net[0].proj, ColumnParallelLinear, tp)
            mlp.net[2] = _split(mlp.net[2], RowParallelLinear, tp)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
