"""Messages between the test process, the prefill host and its ranks: msgspec msgpack over Connection.send_bytes."""

from __future__ import annotations

import msgspec
import torch


class Tensor(msgspec.Struct):
    """A tensor as raw bytes, shape and dtype name (see `pack` and `unpack`)."""

    data: bytes
    shape: list[int]
    dtype: str


def pack(t: torch.Tensor) -> Tensor:
    """The tensor's bytes, shape and dtype, copied off the device."""
    t = t.detach().cpu().contiguous()
    return Tensor(
        t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", list(t.shape), str(t.dtype).removeprefix("torch.")
    )


def unpack(t: Tensor) -> torch.Tensor:
    """A new tensor from `pack`'s message."""
    dtype = getattr(torch, t.dtype)
    return torch.frombuffer(bytearray(t.data), dtype=torch.uint8).view(dtype).reshape(t.shape).clone()


class Outcome(msgspec.Struct, kw_only=True):
    """What one SGLang receiver ended up holding, or how it failed."""

    ok: bool
    error_msg: str | None = None
    error_code: int | None = None
    embeddings: list[Tensor] = msgspec.field(default_factory=list)
    """mm_items[i].precomputed_embeddings, in prompt order."""
    modalities: list[str] = msgspec.field(default_factory=list)
    input_ids: list[int] = msgspec.field(default_factory=list)
    mrope: Tensor | None = None
    grid: dict[str, list[list[int]]] = msgspec.field(default_factory=dict)
    """img_grid_thw / video_grid_thw the receiver handed SGLang's processor."""
    audio_feature_lens: list[int] = msgspec.field(default_factory=list)
    """The audio items' feature frames the receiver handed SGLang's processor (flattened over parts)."""
    extra: dict[str, list[float]] = msgspec.field(default_factory=dict)
    received: dict[str, Tensor] = msgspec.field(default_factory=dict)
    """Per modality (AUDIO, IMAGE, VIDEO), the rows the receiver assembled from the parts and handed SGLang's
    processor, set on a failed outcome too when the processor itself failed on them."""
    rank: int = -1
    engine: str = ""


class Job(msgspec.Struct, kw_only=True):
    """One prefill run: the model, transfer backend and Eric URLs, the request's media and prompt, and its TP size."""

    kind: str  # "tokenizer" (zmq_to_tokenizer) or "scheduler" (zmq_to_scheduler, mooncake, nixl)
    model: str
    backend: str
    encoder_urls: list[str]
    images: list[str] = msgspec.field(default_factory=list)
    videos: list[str] = msgspec.field(default_factory=list)
    audios: list[str] = msgspec.field(default_factory=list)
    prompt: str = ""
    tp: int = 1
    env: dict[str, str] = msgspec.field(default_factory=dict)
    use_bootstrap: bool = False
    local_reference: bool = False
    dtype: str = "auto"  # the prefill's --dtype
    model_impl: str = "auto"  # the prefill's --model-impl
    timeout_s: float = 120.0


class JobResult(msgspec.Struct, kw_only=True):
    """Each rank's (or the tokenizer's) outcome of a job, SGLang's own local result if asked, and a dispatch error."""

    outcomes: list[Outcome]
    local: Outcome | None = None
    dispatch_error: str | None = None


class RankJob(msgspec.Struct, tag=True, kw_only=True):
    """Host -> rank: receive request `rid`'s parts from the encoders as SGLang's scheduler does."""

    model: str
    backend: str
    encoder_urls: list[str]
    rid: str
    prompt: str
    num_items_assigned: dict[str, list[int]]
    env: dict[str, str]
    dtype: str
    timeout_s: float
    model_impl: str = "auto"


class RankEvent(msgspec.Struct, tag=True, kw_only=True):
    """Host -> rank: the tokenizer's dispatch to an encoder failed for `rid` (forwarded as TokenizerManager does)."""

    rid: str
    error_msg: str
    error_code: int


class ParseArgs(msgspec.Struct, tag=True):
    """Command: parse a prefill command line as SGLang's launcher would."""

    argv: list[str]


class ParsedArgs(msgspec.Struct, kw_only=True):
    """What SGLang made of a command line (its disaggregation settings), or the error it raised."""

    error: str | None = None
    language_only: bool = False
    encoder_only: bool = False
    encoder_urls: list[str] = msgspec.field(default_factory=list)
    encoder_transfer_backend: str = ""
    resolved_backend: str = ""
    encoder_register_urls: list[str] = msgspec.field(default_factory=list)
    encoder_bootstrap_port: int = 0
    tp_size: int = 1
    nixl_env: str = ""


class WireCheck(msgspec.Struct, tag=True):
    """Command: check Eric's pickled part header against SGLang's own EmbeddingData."""

    pass


class RunJob(msgspec.Struct, tag=True):
    """Command: run a job."""

    job: Job


class Bootstrap(msgspec.Struct, tag=True):
    """Command: start SGLang's encoder bootstrap server on `port`."""

    port: int


class BootstrapUrls(msgspec.Struct, tag=True):
    """Command: the encoder URLs the bootstrap server holds."""

    pass


class Stop(msgspec.Struct, tag=True):
    """Command: stop the host and its ranks."""

    pass


Command = ParseArgs | WireCheck | RunJob | Bootstrap | BootstrapUrls | Stop
