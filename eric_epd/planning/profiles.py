"""The profile file `eric-epd profile` writes and `eric-epd plan` reads (typed; JSON on disk): what Eric and the engine
measured on each device share, and the traffic mix it was measured with."""

from __future__ import annotations

from pathlib import Path

import msgspec


class Traffic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request mix: images per request, their sides (px, square, equally likely), text prompt and output lengths,
    and (for plans) the arrival rate in requests/s (0: all at once)."""

    images_per_request: int = 4
    sides: tuple[int, ...] = (224, 448)
    prompt_tokens: int = 64
    output_tokens: int = 32
    rate: float = 0.0

    def __post_init__(self) -> None:
        if self.images_per_request < 0 or not self.sides or any(s < 28 or s > 4096 for s in self.sides):
            raise ValueError("traffic: images_per_request >= 0 and sides between 28 and 4096 px")
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.rate < 0:
            raise ValueError("traffic: prompt_tokens and output_tokens >= 1, rate >= 0")


class Slo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request counts toward goodput when its TTFT and its TPOT are both within these (milliseconds)."""

    ttft_ms: float
    tpot_ms: float


class EricPoint(msgspec.Struct, frozen=True):
    """Eric at one client concurrency: items/s, request latency percentiles, mean items per executed batch, and what
    an item cost on the host and in the vision tower (0: not measured, as in profiles written before these were)."""

    concurrency: int
    items_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    batch_items: float
    host_s_per_item: float = 0.0
    """seconds of the router's host stages per item (measure_eric.HOST_STAGES: body read, fetch, decode,
    preprocess, hash, answer)"""
    tower_s_per_item: float = 0.0
    """seconds of the vision tower's forward per item (measure_eric.TOWER_STAGES: batch_compute)"""


class PrefillPoint(msgspec.Struct, frozen=True):
    """One prompt alone: its tokens (image tokens as precomputed embeddings), the seconds to its first token at the
    client, and those of the engine's prefill phase (vLLM's request_prefill_time: scheduled to first token)."""

    tokens: int
    seconds: float
    engine_seconds: float = 0.0


class DecodePoint(msgspec.Struct, frozen=True):
    """`batch` requests decoding together, each after a prompt of `context_tokens`: the median time per output token
    once all of them decode (0 context: a short text prompt, as profiles recorded before contexts were)."""

    batch: int
    tpot_s: float
    context_tokens: int = 0


class EngineSide(msgspec.Struct, frozen=True):
    """The engine fed precomputed embeddings (prefill against prompt length, TPOT against batch), and its own
    encoder: seconds per image token on top of the prefill when it gets raw images (colocated serving)."""

    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    own_encoder_s_per_image_token: float
    own_preprocess_s_per_image_token: float = 0.0
    """what raw images add to a request's time outside the engine's steps (the processor), per image token"""
    saturated_requests_per_s: float = 0.0
    """requests/s of text-only requests as long as the mix's (images included), all sent at once: the engine's
    capacity alone"""


class Share(msgspec.Struct, frozen=True):
    """What was measured on one device share (CPU cores, or GPUs): Eric's frontier and the engine's side."""

    devices: tuple[int, ...]
    eric: list[EricPoint]
    engine: EngineSide

    def host_and_tower(self) -> EricPoint | None:
        """The point whose host and tower seconds per item stand for the share: the highest concurrency that
        measured them (Eric at its busiest); None where no point did (a profile written before they were)."""
        measured = [p for p in self.eric if p.host_s_per_item > 0 or p.tower_s_per_item > 0]
        return max(measured, key=lambda p: p.concurrency) if measured else None


class Profile(msgspec.Struct, frozen=True):
    """A model's profile on one kind of device: per share size, Eric and the engine; the traffic it was measured
    with; the image tokens per side; the analytic cost ratios (planning/costs.py)."""

    model: str
    device: str
    dtype: str
    traffic: Traffic
    image_tokens: dict[int, int]
    cost_ratios: dict[str, float]
    shares: list[Share]
    token_factor: int = 28
    """pixels per image token along a side (patch size x merge size)"""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def image_tokens_for(self, traffic: Traffic) -> dict[int, int]:
        """Image tokens per side of `traffic`: measured where profiled, else as the Qwen-VL processor resizes."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        out = {}
        for side in traffic.sides:
            if side in self.image_tokens:
                out[side] = self.image_tokens[side]
            else:
                h, w = smart_resize(side, side, self.token_factor, self.min_pixels, self.max_pixels)
                out[side] = h * w // (self.token_factor * self.token_factor)
        return out

    def share(self, size: int) -> Share:
        """The share of `size` devices; KeyError naming the sizes profiled otherwise."""
        for s in self.shares:
            if len(s.devices) == size:
                return s
        raise KeyError(
            f"no share of {size} devices in the profile of {self.model} (profiled: "
            f"{sorted(len(s.devices) for s in self.shares)})"
        )


def write_profile(profile: Profile, path: Path) -> None:
    """The profile as indented JSON."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=1))


def read_profile(path: Path) -> Profile:
    """A profile file, validated (a clear error naming the field otherwise)."""
    return msgspec.json.decode(path.read_bytes(), type=Profile)
