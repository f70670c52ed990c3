"""Geri's workload on the shared skeleton: prompt embeddings in, one uint8 RGB image per request out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eric_epd.geri.limits import GenerateSpec, GeriLimits, batch_kind, check_spec, image_tokens
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem, pack_spec, unpack_spec
from eric_epd.runtime.workload import INPUT_BYTES
from eric_epd.wire.geri import MAX_PROMPT_TOKENS


@dataclass(frozen=True)
class GeneratorWorkload:
    """Read from the checkpoint's configs once, in the router's process, then copied to the engine and workers."""

    hidden: int
    """The transformer's prompt width (joint_attention_dim)."""
    size_factor: int
    """Heights and widths are multiples of this (the VAE's downsampling times the 2x2 latent packing)."""
    limits: GeriLimits

    @classmethod
    def from_checkpoint(cls, model: Path, limits: GeriLimits) -> GeneratorWorkload:
        """The prompt width and size factor read from a Qwen-Image diffusers checkpoint's configs."""
        for part in ("transformer", "vae", "scheduler"):
            if not (model / part / ("scheduler_config.json" if part == "scheduler" else "config.json")).exists():
                raise FileNotFoundError(f"{model} is not a Qwen-Image diffusers checkpoint: no {part}/ config")
        transformer = json.loads((model / "transformer" / "config.json").read_text())
        vae = json.loads((model / "vae" / "config.json").read_text())
        return cls(int(transformer["joint_attention_dim"]), 2 ** len(vae.get("temperal_downsample", [])) * 2, limits)

    def item(self, key: str, spec: GenerateSpec, out_offset: int = 0) -> WorkItem:
        """The work item of one request whose image goes to `out_offset` of the pool."""
        return WorkItem(
            key,
            batch_kind(spec),
            image_tokens(spec, self.size_factor),
            out_offset,
            spec.height * spec.width * 3,
            pack_spec(spec),
        )

    def check(self, spec: GenerateSpec) -> str | None:
        """Why a generate request is unacceptable to this model and these limits, or None."""
        return check_spec(spec, self.hidden, self.size_factor, self.limits)

    def validate(self, item: WorkItem, input_nbytes: int) -> str | None:
        """`Workload` hook: why the engine must refuse this generate item (spec, size or byte count), or None."""
        spec = unpack_spec(item, GenerateSpec)
        if spec is None:
            return f"item {item.key}: not a generate item"
        if (problem := self.check(spec)) is not None:
            return problem
        if item != self.item(item.key, spec, item.out_offset):
            return f"item {item.key}: kind, cost or output size do not match its request"
        if input_nbytes != (spec.tokens + spec.negative_tokens) * spec.hidden * INPUT_BYTES:
            return f"item {item.key}: {input_nbytes} embedding bytes do not match its token counts"
        return None

    def max_batch_input_bytes(self, config: RuntimeConfig) -> int:
        """`Workload` hook: the embedding bytes of a full batch of longest prompts, each with a negative prompt."""
        return config.batch_limits().max_items * 2 * MAX_PROMPT_TOKENS * self.hidden * INPUT_BYTES

    def warmup(self, config: RuntimeConfig) -> tuple[WorkItem, np.ndarray]:
        """`Workload` hook: a one-step, one-token image of the smallest size, run by every rank before ready."""
        side = 2 * self.size_factor
        spec = GenerateSpec(side, side, 1, 0, 1.0, 1, 0, self.hidden)
        return self.item("warm-up", spec), np.zeros((1, self.hidden), np.float32)

    def load(self, config: RuntimeConfig, device: torch.device, tp: object) -> GeneratorRunner:
        """`Workload` hook: this rank's Qwen-Image generator, loaded in the resolved dtype."""
        from eric_epd.geri.generator import QwenImageGenerator

        dtype = resolve_dtype(config.dtype, device)
        return GeneratorRunner(QwenImageGenerator(config.model, dtype, str(device), self.limits, tp), dtype)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA (the released weights' dtype), float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class GeneratorRunner:
    """One rank's generator: a batch of requests' embeddings in, each request's image out."""

    generator: object
    dtype: torch.dtype

    def run(self, items: list[WorkItem], inputs: torch.Tensor) -> list[torch.Tensor]:
        """`Runner` hook: each item's prompt (and negative) embeddings cut from the batch input, one image per item."""
        from eric_epd.geri.generator import ImageRequest, QwenImageGenerator

        assert isinstance(self.generator, QwenImageGenerator)
        requests: list[ImageRequest] = []
        offset = 0
        for item in items:
            spec = unpack_spec(item, GenerateSpec)
            assert spec is not None
            prompt = inputs[offset : offset + spec.tokens * spec.hidden].view(spec.tokens, spec.hidden)
            offset += spec.tokens * spec.hidden
            negative = inputs[offset : offset + spec.negative_tokens * spec.hidden].view(-1, spec.hidden)
            offset += spec.negative_tokens * spec.hidden
            requests.append(
                ImageRequest(
                    prompt,
                    spec.height,
                    spec.width,
                    spec.steps,
                    spec.seed,
                    spec.guidance_scale,
                    negative if spec.negative_tokens else None,
                )
            )
        return [torch.from_numpy(image) for image in self.generator.generate(requests)]
