"""Geri's router reads POST /v1/generate (schema in `eric_epd.wire.geri`): parsed and checked, every problem a 400
naming it."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import msgspec
import numpy as np

from eric_epd.common.errors import ApiError
from eric_epd.geri.limits import GenerateSpec
from eric_epd.geri.workload import GeneratorWorkload
from eric_epd.wire.geri import MAX_PROMPT_TOKENS, NEGATIVE, PROMPT, GenerateBody


@dataclass(frozen=True)
class GenerateRequest:
    """A checked request: its spec and its float32 input (the prompt's rows, then the negative prompt's)."""

    spec: GenerateSpec
    embeddings: np.ndarray


def checked_sources(raw: GenerateBody) -> GenerateBody:
    """The decoded body, its embeddings' source checked: a missing or doubled one is a 400."""
    if (raw.embeddings is None) == (raw.prompt_handle is None):
        raise ApiError(400, "send the prompt's embeddings either inline ('embeddings') or by 'prompt_handle'")
    if raw.negative_handle is not None and raw.prompt_handle is None:
        raise ApiError(400, "'negative_handle' goes with 'prompt_handle'; inline embeddings carry their negative")
    return raw


def checked_request(
    raw: GenerateBody, prompt: np.ndarray, negative: np.ndarray | None, workload: GeneratorWorkload
) -> GenerateRequest:
    """The request once its embeddings are at hand: sizes, steps and token counts checked (400 naming them)."""
    if negative is not None and negative.shape[1] != prompt.shape[1]:
        raise ApiError(
            400,
            f"{NEGATIVE} is [{negative.shape[0]}, {negative.shape[1]}], but {PROMPT} has hidden size {prompt.shape[1]}",
        )
    negative_tokens = negative.shape[0] if negative is not None else 0
    spec = _checked_spec(raw, prompt.shape[0], negative_tokens, prompt.shape[1], workload)
    # the generator reads the first MAX_PROMPT_TOKENS rows of each: the rest is not carried to the engine at all
    rows = [prompt[:MAX_PROMPT_TOKENS]] + ([] if negative is None else [negative[:MAX_PROMPT_TOKENS]])
    spec = msgspec.structs.replace(spec, tokens=len(rows[0]), negative_tokens=len(rows[1]) if len(rows) > 1 else 0)
    return GenerateRequest(spec, np.ascontiguousarray(np.concatenate(rows), dtype=np.float32))


def check_before_reading(raw: GenerateBody, workload: GeneratorWorkload) -> None:
    """A request's size, steps, guidance and seed checked before its image slot is reserved (the slot's size comes
    from them) and before any handle is read (a read acknowledges its lease, so a refusal after it would leave the
    caller nothing to retry with); its rows are checked once read or decoded."""
    negative = int(raw.negative_handle is not None)
    _checked_spec(raw, 1, negative, workload.hidden, workload)


def _checked_spec(
    raw: GenerateBody, tokens: int, negative_tokens: int, hidden: int, workload: GeneratorWorkload
) -> GenerateSpec:
    """The request's spec with these row counts, checked against the model and limits (400 naming the problem)."""
    spec = GenerateSpec(raw.height, raw.width, raw.steps, raw.seed, raw.guidance_scale, tokens, negative_tokens, hidden)
    if (problem := workload.check(spec)) is not None:
        raise ApiError(400, problem)
    return spec


def inline_embeddings(encoded: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The prompt's (and negative prompt's) embeddings as float32 [tokens, hidden] arrays, finite."""
    from safetensors.torch import load

    try:
        tensors = load(base64.b64decode(encoded, validate=True))
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"embeddings must be a base64 safetensors file: {e}") from e
    except Exception as e:  # safetensors' own SafetensorError
        raise ApiError(400, f"embeddings are not a readable safetensors file: {e}") from e
    unknown = sorted(set(tensors) - {PROMPT, NEGATIVE})
    if PROMPT not in tensors or unknown:
        raise ApiError(400, f"embeddings must hold {PROMPT!r} (and optionally {NEGATIVE!r}); got {sorted(tensors)}")
    arrays = {name: float_rows(name, tensor) for name, tensor in tensors.items()}
    return arrays[PROMPT], arrays.get(NEGATIVE)


def float_rows(name: str, tensor: object) -> np.ndarray:
    """A floating-point [tokens, hidden] torch tensor as finite float32 rows (400 naming `name` otherwise)."""
    import torch

    assert isinstance(tensor, torch.Tensor)
    if tensor.dim() != 2 or not tensor.is_floating_point():
        raise ApiError(
            400, f"{name} must be a floating-point [tokens, hidden] tensor, got {tensor.dtype} {list(tensor.shape)}"
        )
    array = tensor.to(torch.float32).numpy()
    if not np.isfinite(array).all():
        raise ApiError(400, f"{name} holds non-finite values")
    return array
