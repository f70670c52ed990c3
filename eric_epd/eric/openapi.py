"""Eric's OpenAPI description, written out (its routes read raw bodies, so FastAPI cannot infer them): the request
bodies with their bounds and every documented answer, served at /openapi.json and fuzzed by the tests."""

from __future__ import annotations

from typing import Any

import msgspec

from eric_epd.common.jsonbody import MAX_ID
from eric_epd.wire.sglang import EncodeRequest, MetaRequest, ReceiveUrlRequest, SendRequest

JSON = "application/json"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
SGLANG_ERROR = {
    "type": "object",
    "required": ["status", "message"],
    "properties": {"status": {"const": "error"}, "message": {"type": "string"}, "req_id": {"type": ["string", "null"]}},
}
HASH = {"name": "content_hash", "in": "path", "required": True, "schema": {"type": "string"}}
LEASE = {"name": "X-Eric-Lease", "in": "header", "required": False, "schema": {"type": "string"}}


def _answers(ok: dict[str, Any] | None, error: dict[str, Any] = ERROR, ok_type: str = JSON) -> dict[str, Any]:
    ok_body = {"content": {ok_type: {"schema": ok}}} if ok is not None else {}
    return {
        "200": {"description": "done", **ok_body},
        "default": {"description": "an error, named", "content": {JSON: {"schema": error}}},
    }


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": schema}}}


SOUNDTRACK = {"type": "boolean", "description": "a video's soundtrack too, answered as its 'soundtrack'"}


def _encode_body(modalities: list[str], max_items: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "required": ["modality", "url"],
        "properties": {
            "id": {"type": "string", "maxLength": MAX_ID},
            "modality": {"enum": modalities},
            "url": {"type": "string", "minLength": 1},
            **({"use_audio_in_video": SOUNDTRACK} if "audio" in modalities else {}),
        },
    }
    return {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": item, "minItems": 1, "maxItems": max_items}},
    }


ENCODED = {
    "type": "object",
    "required": ["model", "items"],
    "properties": {
        "model": {"type": "string"},
        "items": {
            "type": "array",
            "items": {"type": "object", "required": ["id", "modality", "hash", "shape", "dtype", "handle"]},
        },
    },
}
HEALTH = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"enum": ["ok", "busy", "unhealthy"]}, "reason": {"type": "string"}},
}
READY = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"enum": ["ready", "not ready"]}, "reason": {"type": "string"}},
}


def _sglang_schemas() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    (encode, receive, meta, send), components = msgspec.json.schema_components(
        [EncodeRequest, ReceiveUrlRequest, MetaRequest, SendRequest], ref_template="#/components/schemas/{name}"
    )
    return {"encode": encode, "receive": receive, "meta": meta, "send": send}, components


def eric_openapi(version: str, modalities: list[str], max_items: int) -> dict[str, Any]:
    """The OpenAPI document of an Eric serving `modalities`, with at most `max_items` items per /v1/encode."""
    sglang, components = _sglang_schemas()
    any_json: dict[str, Any] = {}
    paths: dict[str, Any] = {
        "/v1/encode": {
            "post": {
                "summary": "Encode media items into embeddings held for the caller",
                "requestBody": _body(_encode_body(modalities, max_items)),
                "responses": _answers(ENCODED),
            }
        },
        "/v1/embeddings/{content_hash}": {
            "get": {
                "summary": "An embedding's bytes (safetensors)",
                "parameters": [HASH, LEASE],
                "responses": _answers({}, ok_type="application/octet-stream"),
            }
        },
        "/v1/embeddings/{content_hash}/ack": {
            "post": {
                "summary": "End the lease the token names (a retry of one that took effect: 'already acknowledged'); "
                "with keep, a child lease takes its place",
                "parameters": [HASH, LEASE],
                "requestBody": _body(
                    {
                        "type": "object",
                        "properties": {
                            "instance_id": {"type": "string"},
                            "retry": {"type": "boolean"},
                            "keep": {"type": "boolean"},
                        },
                    },
                    False,
                ),
                "responses": _answers(
                    {"type": "object", "properties": {"status": {"type": "string"}, "lease": {"type": "string"}}}
                ),
            }
        },
        "/v1/embeddings/{content_hash}/handle": {
            "get": {
                "summary": "Where the leased embedding can be read",
                "parameters": [HASH, LEASE],
                "responses": _answers({"type": "object"}),
            }
        },
        "/v1/embeddings/{content_hash}/lease": {
            "post": {
                "summary": "Child leases of the token's lease",
                "parameters": [HASH, LEASE],
                "requestBody": _body({"type": "object", "properties": {"count": {"type": "integer"}}}, False),
                "responses": _answers({"type": "object"}),
            }
        },
        "/v1/transfer": {"get": {"summary": "Transfer pool statistics", "responses": _answers({"type": "object"})}},
        "/v1/transfer/nixl/metadata": {
            "get": {
                "summary": "This Eric's NIXL agent metadata",
                "responses": _answers({}, ok_type="application/octet-stream"),
            }
        },
        "/health": {
            "get": {
                "summary": "Liveness: the engine and every worker live (busy while a batch runs)",
                "responses": {
                    "200": {"description": "alive: ok, or busy", "content": {JSON: {"schema": HEALTH}}},
                    "503": {"description": "dead, with the reason", "content": {JSON: {"schema": HEALTH}}},
                },
            }
        },
        "/ready": {
            "get": {
                "summary": "Readiness: alive, and admitting items now",
                "responses": {
                    "200": {"description": "ready", "content": {JSON: {"schema": READY}}},
                    "503": {
                        "description": "not ready (dead, or its queue full), with the reason",
                        "content": {JSON: {"schema": READY}},
                    },
                },
            }
        },
        "/v1/models": {"get": {"summary": "The model served", "responses": _answers({"type": "object"})}},
        "/v1/load": {
            "get": {
                "summary": "Queue depth, busy fraction, items/s, p99 encode latency (last 30 s)",
                "responses": _answers(
                    {
                        "type": "object",
                        "required": ["queue_depth", "busy_fraction", "items_per_s", "p99_encode_s", "window_s"],
                    }
                ),
            }
        },
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": _answers({}, ok_type="text/plain")}},
        "/health_generate": {
            "get": {
                "summary": "SGLang's encoder health probe",
                "responses": {"200": {"description": "healthy"}, "503": {"description": "unhealthy"}},
            }
        },
    }
    for path, name in (
        ("/encode", "encode"),
        ("/scheduler_receive_url", "receive"),
        ("/scheduler_receive_meta_data", "meta"),
        ("/send", "send"),
    ):
        paths[path] = {
            "post": {
                "summary": f"SGLang encoder protocol: {path}",
                "requestBody": _body(sglang[name]),
                "responses": _answers(any_json, SGLANG_ERROR),
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Eric encode server", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
