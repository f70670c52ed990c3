"""What Geri accepts: the bounds on one image request, and the one check of a request's sizes that the router, the
engine and the model all apply."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class GenerateSpec(msgspec.Struct, array_like=True, frozen=True, tag="generate"):
    """One image to generate; its float32 input is the prompt's [tokens, hidden] embeddings followed by the
    negative prompt's [negative_tokens, hidden] (none when negative_tokens is 0)."""

    height: int
    width: int
    steps: int
    seed: int
    guidance_scale: float
    tokens: int
    negative_tokens: int
    hidden: int


@dataclass(frozen=True)
class GeriLimits:
    """The bounds on one image request: side in pixels, denoising steps, prompt tokens and guidance scale."""

    max_side: int = 1024
    max_steps: int = 100
    max_prompt_tokens: int = 4096
    """Longest prompt (in tokens) accepted at all; longer ones are refused. Those past MAX_PROMPT_TOKENS are cut to
    it, as QwenImagePipeline cuts them (its max_sequence_length), so the image equals the pipeline's."""
    max_guidance_scale: float = 100.0

    def __post_init__(self) -> None:
        if self.max_side < 1 or self.max_steps < 1 or self.max_prompt_tokens < 1 or self.max_guidance_scale < 1:
            raise ValueError("Geri's limits must be positive (max_guidance_scale >= 1)")


def uses_cfg(spec: GenerateSpec) -> bool:
    """Classifier-free guidance runs when negative embeddings are given and the scale is above 1."""
    return spec.negative_tokens > 0 and spec.guidance_scale > 1


def batch_kind(spec: GenerateSpec) -> str:
    """Requests of one kind run as one batch: same size, step count and guidance on or off."""
    return f"{spec.height}x{spec.width}/{spec.steps}/{'cfg' if uses_cfg(spec) else 'plain'}"


def image_tokens(spec: GenerateSpec, size_factor: int) -> int:
    """The transformer's image tokens for this size (packed 2x2 latent patches): the request's batch cost."""
    return (spec.height // size_factor) * (spec.width // size_factor)


def check_spec(spec: GenerateSpec, hidden: int, size_factor: int, limits: GeriLimits) -> str | None:
    """What is wrong with a request's sizes and settings, named for the client, or None."""
    if spec.hidden != hidden:
        return f"prompt embeddings must be [tokens, {hidden}] for this model, got hidden size {spec.hidden}"
    for name, tokens in (("prompt_embeds", spec.tokens), ("negative_prompt_embeds", spec.negative_tokens)):
        low = 1 if name == "prompt_embeds" else 0
        if not low <= tokens <= limits.max_prompt_tokens:
            return f"{name} has {tokens} tokens; {max(low, 1)} to {limits.max_prompt_tokens} accepted"
    for name, side in (("height", spec.height), ("width", spec.width)):
        if not 0 < side <= limits.max_side or side % size_factor:
            return f"{name} {side} must be a multiple of {size_factor} up to {limits.max_side}"
    if not 1 <= spec.steps <= limits.max_steps:
        return f"steps {spec.steps} must be 1 to {limits.max_steps}"
    if not 0 <= spec.guidance_scale <= limits.max_guidance_scale:
        return f"guidance_scale {spec.guidance_scale} must be 0 to {limits.max_guidance_scale}"
    if not 0 <= spec.seed < 2**63:
        return f"seed {spec.seed} must be 0 to 2**63-1"
    return None
