"""Geri's model: Qwen-Image's transformer, flow-matching scheduler and VAE (diffusers modules, loaded from a
pipeline checkpoint without its text encoder) turning prompt embeddings into images, a batch of requests of one size
and step count at a time. Each request's noise comes from its own seed, so its image does not depend on its batch."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eric_epd.geri.limits import GenerateSpec, GeriLimits, check_spec
from eric_epd.geri.parallel import shard_qwen_image_transformer
from eric_epd.models.layers.parallel import TPContext
from eric_epd.wire.geri import MAX_PROMPT_TOKENS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageRequest:
    """One image to generate: a prompt's embeddings ([tokens, hidden]) and the sampling settings."""

    prompt_embeds: torch.Tensor
    height: int
    width: int
    steps: int
    seed: int
    true_cfg_scale: float = 4.0
    negative_embeds: torch.Tensor | None = None
    """Classifier-free guidance runs when these are given and true_cfg_scale > 1 (as in QwenImagePipeline)."""

    @property
    def uses_cfg(self) -> bool:
        """Whether this request runs classifier-free guidance (negative embeddings and `true_cfg_scale` > 1)."""
        return self.negative_embeds is not None and self.true_cfg_scale > 1

    def batch_key(self) -> tuple[int, int, int, bool]:
        """Requests with equal keys run as one batch."""
        return self.height, self.width, self.steps, self.uses_cfg

    def spec(self) -> GenerateSpec:
        """The request's sizes and settings as they cross processes."""
        negative = self.negative_embeds
        return GenerateSpec(
            self.height,
            self.width,
            self.steps,
            self.seed,
            self.true_cfg_scale,
            self.prompt_embeds.shape[0] if self.prompt_embeds.dim() == 2 else 0,
            negative.shape[0] if negative is not None and negative.dim() == 2 else 0,
            self.prompt_embeds.shape[-1],
        )


class QwenImageGenerator:
    """The three modules of a Qwen-Image checkpoint, on one device in one dtype."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        limits: GeriLimits | None = None,
        tp: TPContext | None = None,
    ) -> None:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from diffusers.image_processor import VaeImageProcessor

        self.device, self.dtype, self.limits = torch.device(device), dtype, limits or GeriLimits()
        self.transformer = QwenImageTransformer2DModel.from_pretrained(model_dir / "transformer", torch_dtype=dtype)
        if isinstance(tp, TPContext):
            shard_qwen_image_transformer(self.transformer, tp)  # before the move: only this rank's shard goes
        self.transformer.to(self.device).eval()
        self.vae = AutoencoderKLQwenImage.from_pretrained(model_dir / "vae", torch_dtype=dtype).to(self.device).eval()
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler")
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        self.hidden = self.transformer.config.joint_attention_dim
        if self.transformer.config.guidance_embeds:
            raise ValueError("guidance-distilled Qwen-Image transformers are not supported yet")

    @property
    def size_factor(self) -> int:
        """Heights and widths must be multiples of this (the VAE's downsampling times the latents' 2x2 packing)."""
        return self.vae_scale_factor * 2

    def check(self, request: ImageRequest) -> None:
        """ValueError naming what is wrong with the request (the server answers it with a 400)."""
        for name, embeds in (("prompt_embeds", request.prompt_embeds), ("negative_embeds", request.negative_embeds)):
            if embeds is not None and embeds.dim() != 2:
                raise ValueError(f"{name} must be [tokens, {self.hidden}], got {list(embeds.shape)}")
            if embeds is not None and not torch.isfinite(embeds).all():
                raise ValueError(f"{name} holds non-finite values")
        problem = check_spec(request.spec(), self.hidden, self.size_factor, self.limits)
        if problem is not None:
            raise ValueError(problem)

    def _noise(self, request: ImageRequest) -> torch.Tensor:
        """The request's packed initial latents, drawn from its own seed exactly as the pipeline draws them."""
        from diffusers.utils.torch_utils import randn_tensor

        channels = self.transformer.config.in_channels // 4
        h = 2 * (request.height // self.size_factor)
        w = 2 * (request.width // self.size_factor)
        generator = torch.Generator(device="cpu").manual_seed(request.seed)
        noise = randn_tensor((1, 1, channels, h, w), generator=generator, device=self.device, dtype=self.dtype)
        noise = noise.view(1, channels, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return noise.reshape(1, (h // 2) * (w // 2), channels * 4)

    def _prompts(self, embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts padded to the longest, with the mask (None when nothing is padded, as the pipeline passes it)."""
        embeds = [e[:MAX_PROMPT_TOKENS].to(self.device, self.dtype) for e in embeds]
        longest = max(e.shape[0] for e in embeds)
        padded = torch.zeros(len(embeds), longest, self.hidden, device=self.device, dtype=self.dtype)
        mask = torch.zeros(len(embeds), longest, device=self.device, dtype=torch.long)
        for i, e in enumerate(embeds):
            padded[i, : e.shape[0]], mask[i, : e.shape[0]] = e, 1
        return padded, None if bool(mask.all()) else mask

    def _timesteps(self, steps: int, image_tokens: int) -> tuple[object, torch.Tensor]:
        """A scheduler of the batch's own (its step index is state), set as QwenImagePipeline sets it."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        scheduler = copy.deepcopy(self.scheduler)
        cfg = scheduler.config
        mu = calculate_shift(
            image_tokens,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device=self.device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def generate(self, batch: list[ImageRequest]) -> list[np.ndarray]:
        """One uint8 [height, width, 3] image per request, rounded as the pipeline's PIL output is."""
        return [(image * 255).round().astype(np.uint8) for image in self.generate_floats(batch)]

    @torch.no_grad()
    def generate_floats(self, batch: list[ImageRequest]) -> list[np.ndarray]:
        """One float [height, width, 3] image in [0, 1] per request (the pipeline's output_type="np"); the batch
        shares one batch_key()."""
        first = batch[0]
        if any(r.batch_key() != first.batch_key() for r in batch):
            raise ValueError("a batch must share height, width, steps and guidance")
        latents = torch.cat([self._noise(r) for r in batch])
        embeds, mask = self._prompts([r.prompt_embeds for r in batch])
        negative = self._prompts([r.negative_embeds for r in batch]) if first.uses_cfg else None
        scale = torch.tensor([r.true_cfg_scale for r in batch], device=self.device, dtype=self.dtype).view(-1, 1, 1)
        shapes = [[(1, first.height // self.size_factor, first.width // self.size_factor)]] * len(batch)
        scheduler, timesteps = self._timesteps(first.steps, latents.shape[1])
        for t in timesteps:
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            pred = self._predict(latents, timestep, embeds, mask, shapes)
            if negative is not None:
                uncond = self._predict(latents, timestep, *negative, shapes)
                combined = uncond + scale * (pred - uncond)
                pred = combined * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
            latents = scheduler.step(pred, t, latents, return_dict=False)[0]
        return self._decode(latents, first.height, first.width)

    def _predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        embeds: torch.Tensor,
        mask: torch.Tensor | None,
        shapes: list,
    ) -> torch.Tensor:
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=shapes,
            attention_kwargs={},
            return_dict=False,
        )[0]

    def _decode(self, latents: torch.Tensor, height: int, width: int) -> list[np.ndarray]:
        """Unpack, de-normalise and decode the latents into float images in [0, 1]."""
        b, _, channels = latents.shape
        h, w = 2 * (height // self.size_factor), 2 * (width // self.size_factor)
        latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        latents = latents.reshape(b, channels // 4, 1, h, w).to(self.vae.dtype)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        images = self.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return list(self.image_processor.postprocess(images, output_type="np"))
