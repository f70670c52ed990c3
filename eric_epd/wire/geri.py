"""Gateway↔Geri: the body of Geri's POST /v1/generate and how a client builds it from embeddings."""

from __future__ import annotations

import base64

import msgspec
import numpy as np

from eric_epd.wire.handles import EmbeddingHandle

PROMPT, NEGATIVE = "prompt_embeds", "negative_prompt_embeds"
MAX_PROMPT_TOKENS = 512
"""Prompt embeddings beyond this many tokens are cut, as QwenImagePipeline cuts them (max_sequence_length): Geri
cuts them, and the gateway asks its text encoder for no more."""


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/generate: the embeddings either inline, as a base64 safetensors file holding `prompt_embeds`
    [tokens, hidden] and optionally `negative_prompt_embeds`, or by transfer handle (`prompt_handle`, optionally
    `negative_handle`) held by one of Geri's configured producers."""

    embeddings: str | None = None
    prompt_handle: EmbeddingHandle | None = None
    negative_handle: EmbeddingHandle | None = None
    height: int = 1024
    width: int = 1024
    steps: int = 50
    seed: int = 0
    guidance_scale: float = 4.0


def generate_body(prompt: np.ndarray, negative: np.ndarray | None = None, **settings: object) -> dict:
    """A /v1/generate JSON body for float32 [tokens, hidden] embeddings; `settings`: GenerateBody's other fields."""
    from safetensors.numpy import save

    tensors = {PROMPT: np.ascontiguousarray(prompt, np.float32)}
    if negative is not None:
        tensors[NEGATIVE] = np.ascontiguousarray(negative, np.float32)
    return {"embeddings": base64.b64encode(save(tensors)).decode(), **settings}
