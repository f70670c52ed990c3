"""SGLang 0.5.23 encoder-disaggregation wire format, shared by Eric (eric/sglang) and the plugin inside SGLang: typed
HTTP bodies, and the part header SGLang unpickles, written by hand from allowlisted globals only (Eric never reads a
pickle)."""

from __future__ import annotations

import base64
import logging
import struct
from typing import Annotated, Any

import msgspec

from eric_epd.common.jsonbody import MAX_ID, MAX_URL

logger = logging.getLogger(__name__)

SGLANG_VERSIONS = ("0.5.23",)
"""Versions whose receiver classes the tests drive (tests/sglang/test_sglang_adapter.py)."""

MODALITY_VALUES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}
"""sglang.srt.multimodal.modality.Modality (an Enum with auto() values)."""

TORCH_DTYPES = ("float32", "bfloat16", "float16")

_EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
_MODALITY = ("sglang.srt.multimodal.modality", "Modality")


# --------------------------------------------------------------------------------------------------------------------
# HTTP bodies SGLang's receivers send (extra fields are ignored, as SGLang's own encoder does); every field bounded.
# --------------------------------------------------------------------------------------------------------------------

ReqId = Annotated[str, msgspec.Meta(max_length=MAX_ID)]
Modality = Annotated[str, msgspec.Meta(max_length=16)]
Host = Annotated[str, msgspec.Meta(max_length=255)]
Url = Annotated[str, msgspec.Meta(max_length=MAX_URL)]
Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Address = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
SessionId = Annotated[str, msgspec.Meta(max_length=1 << 16)]


class EncodeRequest(msgspec.Struct, kw_only=True):
    """POST /encode: one part (the items one encoder got) of a request split across `num_parts` encoders."""

    req_id: ReqId
    mm_items: list[str | dict[str, Any]]
    num_parts: Count
    part_idx: Count
    modality: Modality = "IMAGE"
    prefill_host: Host | None = None
    embedding_port: Port | list[Port] | None = None
    """zmq_to_tokenizer: the tokenizer's PULL port. None for zmq_to_scheduler and mooncake (ranks come later)."""
    encoder_idx: Count | None = None
    encoder_url: Url | None = None
    time_stats_json: Any = None
    hashes: Any = None


class ReceiveUrlRequest(msgspec.Struct, kw_only=True):
    """POST /scheduler_receive_url (zmq_to_scheduler): one TP rank's PULL endpoint for part `req_id`."""

    req_id: ReqId
    receive_count: Count
    receive_url: Url
    modality: Modality | None = None


class MetaRequest(msgspec.Struct, kw_only=True):
    """POST /scheduler_receive_meta_data (mooncake): a rank asks the part's size before allocating its buffer."""

    req_id: ReqId
    part_idx: Count


class SendRequest(msgspec.Struct, kw_only=True):
    """POST /send (mooncake, and the NIXL plugin): write the part to `buffer_address` of `session_id`, then tell
    the rank over ZMQ at prefill_host:embedding_port."""

    req_id: ReqId
    part_idx: Count
    prefill_host: Host
    embedding_port: Port
    session_id: SessionId
    buffer_address: Address
    receive_count: Count | None = None
    embedding_size: Address | None = None


class RegisterBody(msgspec.Struct):
    """POST /register_encoder_url and DELETE /unregister_encoder_url of SGLang's EncoderBootstrapServer."""

    url: str


class NixlSession(msgspec.Struct, frozen=True):
    """What the prefill-side NIXL engine puts in `session_id` (as "nixl1:" + base64 msgpack)."""

    agent_metadata: bytes
    mem_type: str
    """"DRAM" or "VRAM": how the landing buffers are registered."""
    device: int = 0


NIXL_SESSION_PREFIX = "nixl1:"


def encode_nixl_session(session: NixlSession) -> str:
    """The session as the prefill passes it: "nixl1:" and the urlsafe base64 of its msgpack."""
    return NIXL_SESSION_PREFIX + base64.urlsafe_b64encode(msgspec.msgpack.encode(session)).decode()


def decode_nixl_session(session_id: str) -> NixlSession | None:
    """The NIXL session in a /send body, None when it is a Mooncake session id (host:port)."""
    if not session_id.startswith(NIXL_SESSION_PREFIX):
        return None
    raw = base64.urlsafe_b64decode(session_id[len(NIXL_SESSION_PREFIX) :].encode())
    return msgspec.msgpack.decode(raw, type=NixlSession)


# --------------------------------------------------------------------------------------------------------------------
# The part message: the same attributes SGLang's own encoder pickles (EmbeddingData.copy_without_embedding()).
# --------------------------------------------------------------------------------------------------------------------


class EmbeddingPart(msgspec.Struct, kw_only=True):
    """One part as SGLang's receivers aggregate it; the tensor itself travels as ZMQ frame 1 or by RDMA."""

    req_id: str
    num_parts: int
    part_idx: int
    modality: str
    grid: list[list[int]] | list[int] | None
    """(t, h, w) per item, as the HF processor reports image_grid_thw / video_grid_thw; for AUDIO, each item's
    feature frames (audio_feature_lens_raw), written as the int64 tensor SGLang's encoder sends (its receiver
    flattens it)."""
    dtype: str | None
    shape: list[int] | None
    error_msg: str | None = None
    error_code: int | None = None
    extra: dict[str, list[float] | list[list[float]]] = msgspec.field(default_factory=dict)
    """Per-item video metadata SGLang forwards to its processor (second_per_grid_ts for Qwen2.5-VL, each video's
    video_timestamps for Qwen3-VL)."""
    float_tensors: dict[str, list[float]] = msgspec.field(default_factory=dict)
    """Per-item video metadata written as a float32 tensor, as SGLang's own encoder sends it (second_per_grid_ts for
    Qwen3-Omni, whose M-RoPE calls `.cpu()` on each item's value)."""


class _Global(msgspec.Struct, frozen=True):
    module: str
    name: str


class _Reduce(msgspec.Struct, frozen=True):
    func: _Global
    args: tuple[Any, ...]


class _PickleWriter:
    """Protocol-4 opcodes for None, bool, int, float, str, list, tuple, dict, globals and REDUCE; no memo."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x04")  # PROTO 4

    def value(self, v: Any) -> None:
        out = self.out
        if v is None:
            out += b"N"
        elif v is True:
            out += b"\x88"
        elif v is False:
            out += b"\x89"
        elif isinstance(v, int):
            self._int(v)
        elif isinstance(v, float):
            out += b"G" + struct.pack(">d", v)
        elif isinstance(v, str):
            data = v.encode("utf-8", "surrogatepass")
            out += (b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + struct.pack("<I", len(data))) + data
        elif isinstance(v, list):
            out += b"](" if v else b"]"
            for item in v:
                self.value(item)
            if v:
                out += b"e"  # APPENDS
        elif isinstance(v, tuple):
            out += b"("
            for item in v:
                self.value(item)
            out += b"t"
        elif isinstance(v, dict):
            out += b"}(" if v else b"}"
            for key, item in v.items():
                self.value(key)
                self.value(item)
            if v:
                out += b"u"  # SETITEMS
        elif isinstance(v, _Global):
            self.value(v.module)
            self.value(v.name)
            out += b"\x93"  # STACK_GLOBAL
        elif isinstance(v, _Reduce):
            self.value(v.func)
            self.value(v.args)
            out += b"R"
        else:
            raise TypeError(f"cannot write {type(v).__name__} into an SGLang part message")

    def _int(self, v: int) -> None:
        if 0 <= v < 256:
            self.out += b"K" + bytes([v])
        elif 0 <= v < 65536:
            self.out += b"M" + struct.pack("<H", v)
        elif -(2**31) <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data  # LONG1

    def new_object(self, cls: _Global, state: dict[str, Any]) -> bytes:
        self.value(cls)
        self.out += b")\x81"  # EMPTY_TUPLE, NEWOBJ: cls.__new__(cls)
        self.value(state)
        self.out += b"b."  # BUILD (obj.__dict__.update(state)), STOP
        return bytes(self.out)


def embedding_data_pickle(part: EmbeddingPart) -> bytes:
    """The pickle of the EmbeddingData SGLang's own encoder would send for `part` (its attributes, in its order).

    SGLang's receivers read every ZMQ part message with ``safe_pickle_loads`` (an allowlisting unpickler) and expect
    a ``sglang.srt.disaggregation.encoder.receiver.EmbeddingData``. These protocol-4 opcodes name only globals on
    that allowlist (``EmbeddingData``, ``Modality``, ``torch.<dtype>``, ``torch.LongTensor`` for an audio part's
    frame counts, ``torch.FloatTensor`` for `float_tensors`), with plain lists and numbers for the rest;
    no stdlib pickler runs, and sglang need not be installed next to Eric.
    """
    if part.modality not in MODALITY_VALUES:
        raise ValueError(f"unknown modality {part.modality!r}")
    if part.dtype is not None and part.dtype not in TORCH_DTYPES:
        raise ValueError(f"unsupported dtype {part.dtype!r}")
    state: dict[str, Any] = {
        "req_id": part.req_id,
        "num_parts": part.num_parts,
        "part_idx": part.part_idx,
        "grid_dim": _Reduce(_Global("torch", "LongTensor"), (part.grid,))
        if part.modality == "AUDIO" and part.grid is not None
        else part.grid,
        "modality": _Reduce(_Global(*_MODALITY), (MODALITY_VALUES[part.modality],)),
        "embedding": None,
        "send_time": None,
        "dtype": _Global("torch", part.dtype) if part.dtype is not None else None,
        "shape": part.shape,
        "_mr_ptr": None,
        "error_msg": part.error_msg,
        "error_code": part.error_code,
    }
    for key, values in [*part.extra.items(), *part.float_tensors.items()]:
        if key in state or key.startswith("_"):
            raise ValueError(f"extra attribute {key!r} would shadow an EmbeddingData field")
        state[key] = (
            _Reduce(_Global("torch", "FloatTensor"), ([float(v) for v in values],))
            if key in part.float_tensors
            else values
        )
    return _PickleWriter().new_object(_Global(*_EMBEDDING_DATA), state)
