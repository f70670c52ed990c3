"""SGLang 0.5.23 encoder-protocol pieces with no I/O: request checks, errors shaped like SGLang's, the state of
one part, and the dtype the prefill reads its rows in."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from eric_epd.common.errors import ApiError
from eric_epd.eric.answers import ItemAnswer
from eric_epd.eric.sglang.push import PushError
from eric_epd.transfer.pool import PoolEntry
from eric_epd.wire.sglang import EncodeRequest

# SGLang's encoder health probe image (http_server.MINIMUM_PNG_PICTURE_BASE64): a 32x32 black PNG.
HEALTH_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAYAAABzenr0AAAACXBIWXMAAA7EAAAOxAGVKw4bAAAAbUlEQVRYhe3VsQ2AMAx"
    "E0Y/lIgNQULD/OqyCMgCihCKSG4yRuKuiNH6JLsoEbMACOGBcua9HOR7Y6w6swBwMy0qLTpkeI77qdEBpBFAHBBDAGH8WrwJKI4AAegUCfAKgEgpQDvh3CR3oQ"
    "Cuav58qlAw73kKCSgAAAABJRU5ErkJggg=="
)
MAX_RANKS = 1024
"""Most prefill ranks one part is delivered to (receive_count, or the ports an /encode names): bounds each part's
destinations."""
MODALITIES = {"IMAGE": "image", "VIDEO": "video", "AUDIO": "audio"}
_URL_SCHEMES = ("http://", "https://", "data:", "file://")

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def wire_dtype(setting: str, model_cfg: dict[str, Any]) -> str:
    """The dtype SGLang's prefill runs the model in, by its own --dtype auto rule (model_config._get_and_verify_dtype:
    the checkpoint's dtype, but float16 for a float32 checkpoint), unless set explicitly."""
    if setting != "auto":
        if setting not in ELEMENT_BYTES:
            raise ValueError(f"the SGLang dtype must be auto, float32, bfloat16 or float16, not {setting!r}")
        return setting
    text = model_cfg.get("text_config") or {}
    declared = str(
        model_cfg.get("dtype")
        or model_cfg.get("torch_dtype")
        or text.get("dtype")
        or text.get("torch_dtype")
        or "float32"
    ).removeprefix("torch.")
    if declared in ("float32", "float"):
        return "float16"
    return declared if declared in ELEMENT_BYTES else "float16"


SECONDS_PER_GRID_FAMILIES = frozenset({"qwen3_omni_moe"})
"""The generic-path families whose videos SGLang's receivers need `second_per_grid_ts` for (its Qwen3-Omni M-RoPE
indexes it); Eric's items of these carry none, so the route sends what SGLang's own encoder does."""
SGLANG_VIDEO_FPS = 2.0
"""The fps SGLang 0.5.23's encoder divides the temporal patch by (preprocessor.py: the server's
`vision_config.video.fps`, unset by default, `or 2`), whatever rate the video's frames were taken at."""


def sglang_video_seconds(model_cfg: dict[str, Any]) -> float | None:
    """The `second_per_grid_ts` SGLang's own encoder sends with every video of this checkpoint's family
    (temporal_patch_size / SGLANG_VIDEO_FPS), or None for a family outside SECONDS_PER_GRID_FAMILIES."""
    if model_cfg.get("model_type") not in SECONDS_PER_GRID_FAMILIES:
        return None
    vision = (model_cfg.get("thinker_config") or model_cfg).get("vision_config") or {}
    return float(vision.get("temporal_patch_size", 2)) / SGLANG_VIDEO_FPS


class SglangError(ApiError):
    """An ApiError of the SGLang routes, answered there as SGLang's encoder answers (sglang_error_response)."""


@contextlib.contextmanager
def as_sglang_error(failure: str) -> Iterator[None]:
    """An error inside as SGLang's encoder answers it: an SglangError as it is, a push engine's (PushError) as a 500
    with its own message, any other as a 500 "<failure>: <type>: <message>"."""
    try:
        yield
    except SglangError:
        raise
    except PushError as e:
        raise SglangError(500, str(e)) from e
    except Exception as e:
        raise SglangError(500, f"{failure}: {type(e).__name__}: {e}") from e


def sglang_error_response(status: int, message: str, req_id: str | None) -> JSONResponse:
    """SGLang's own error shape, which its receivers parse: {"status": "error", "message", "req_id"}."""
    return JSONResponse({"status": "error", "message": message, "req_id": req_id}, status)


def tcp_endpoint(endpoint: str) -> str:
    """ "host:port" (IPv6 in brackets) as a ZMQ tcp endpoint."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise SglangError(400, f"bad receive endpoint {endpoint!r}; expected host:port")
    return f"tcp://{host}:{port}"


def host_port(host: str, port: int) -> str:
    """ "host:port", with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def item_url(item: str | dict[str, Any], index: int) -> str:
    """SGLang's mm_item (a URL, data URL, local path or raw base64; or {"url", ...options}) as an Eric media URL."""
    if isinstance(item, dict):
        options = sorted(k for k, v in item.items() if k not in ("url", "content_hash", "modality") and v is not None)
        if options:
            raise SglangError(
                400,
                f"mm_items[{index}]: per-item options {options} are not supported by Eric "
                "(it preprocesses with the checkpoint's processor settings)",
            )
        url = item.get("url")
    else:
        url = item
    if not isinstance(url, str) or not url:
        raise SglangError(400, f"mm_items[{index}] has no url")
    if url.startswith(_URL_SCHEMES):
        return url
    if url.startswith("/"):
        return "file://" + url  # Eric serves files only under its --file-root directories
    return "data:application/octet-stream;base64," + url  # SGLang's loaders take bare base64 too


def health_item(modalities: tuple[str, ...]) -> tuple[str, str]:
    """(modality, URL) of the /health_generate probe: SGLang's own probe image, or for an audio-only model one
    second of silence (SGLang probes audio encoders with 10 ms of it, too short to give Qwen2-Audio a token)."""
    if "image" in modalities:
        return "image", HEALTH_PNG
    import base64
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(2 * 16000))
    return "audio", "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def validate(req: EncodeRequest, max_items: int, modalities: tuple[str, ...]) -> None:
    """The checks of SGLang's runtime.validate_encode_request, with its messages; and that this Eric's model takes
    the part's modality (`modalities`: Eric's names, e.g. ("audio",))."""
    if not req.req_id:
        raise SglangError(400, "missing or invalid req_id")
    if req.modality.upper() not in MODALITIES:
        raise SglangError(400, f"unsupported modality: {req.modality}")
    if MODALITIES[req.modality.upper()] not in modalities:
        raise SglangError(
            400, f"unsupported modality: {req.modality} (this Eric's model encodes {', '.join(modalities)})"
        )
    if not req.mm_items:
        raise SglangError(400, "missing or empty mm_items")
    if len(req.mm_items) > max_items:
        raise SglangError(400, f"too many mm_items: {len(req.mm_items)} > {max_items}")
    if req.num_parts <= 0:
        raise SglangError(400, "num_parts must be a positive integer")
    if not 0 <= req.part_idx < req.num_parts:
        raise SglangError(400, f"part_idx must be in [0, {req.num_parts})")


@dataclass
class Part:
    """One encoder part (SGLang req_id "<rid>_local_part_<i>") from its first sighting until it is released."""

    req_id: str
    touched: float = field(default_factory=time.monotonic)
    request: EncodeRequest | None = None
    answers: list[ItemAnswer] | None = None
    error: tuple[str, int] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the encode finished, successfully (answers) or not (error)."""
    mode: str | None = None
    """"tokenizer", "scheduler" (zmq_to_scheduler) or "pull" (mooncake / NIXL), fixed by the first caller."""
    mode_set: asyncio.Event = field(default_factory=asyncio.Event)
    owner: str | None = None
    creator: str | None = None
    """The address whose call made the part (a rank's, before any /encode: counted against its quota)."""
    """The address the part's /encode came from; its ranks must call from there or from the allowlist."""
    destinations: dict[str, str | None] = field(default_factory=dict)
    """zmq_to_scheduler: checked rank endpoint ("ip:port") -> the address that registered it."""
    expected: int | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    sent_to: set[str] = field(default_factory=set)
    active: int = 0
    released: bool = False
    delivering: bool = False
    acked: bool = False
    staged: PoolEntry | None = None
    """The pool entry of the part's rows converted to the wire dtype (one contiguous entry), when Eric's dtype
    differs."""
    wire_bytes: int = 0

    def set_mode(self, mode: str) -> None:
        """Fix the part's delivery mode on first use; 400 if a later caller asks for another."""
        if self.mode is None:
            self.mode = mode
            self.mode_set.set()
        elif self.mode != mode:
            raise SglangError(
                400,
                f"req_id={self.req_id} is already served as {self.mode}, not {mode}: "
                "every prefill rank must use the same --encoder-transfer-backend",
            )

    def drop_destinations(self, keep: Callable[[str | None], bool]) -> list[str]:
        """Forget ranks whose registering address `keep` refuses; with none left, the next rank sets the mode."""
        dropped = [ep for ep, who in self.destinations.items() if not keep(who)]
        for endpoint in dropped:
            del self.destinations[endpoint]
        if dropped and not self.destinations:
            self.expected, self.mode = None, None
            self.mode_set.clear()
        return dropped

    @property
    def tokens(self) -> int:
        """Merged tokens over all of the part's items."""
        return sum(a.handle.shape[0] for a in self.answers or ())
