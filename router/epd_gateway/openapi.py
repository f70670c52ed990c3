"""The gateway's OpenAPI description, written out (plain Starlette infers none): the OpenAI-compatible routes it
serves with the request shapes it accepts (boundary.py enforces them) and every documented answer."""

from __future__ import annotations

from typing import Any

from eric_epd.common.jsonbody import MAX_ID, MAX_URL

JSON = "application/json"
ERROR = {
    "anyOf": [
        {
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
        },
        {"type": "object", "required": ["error"], "properties": {"error": {"const": "Unauthorized"}}},
    ]
}
"""vLLM's OpenAI error shape; a missing or wrong API key answers exactly what vLLM answers."""

_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "additionalProperties": False,
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}


def _closed(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema object with these properties only, `required` of them required."""
    return {"type": "object", "required": required, "additionalProperties": False, "properties": properties}


def _part(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A content part: {"type": kind, kind: body}."""
    return _closed(["type", kind], {"type": {"const": kind}, kind: body})


_URL = _closed(["url"], {"url": {"type": "string"}})
_IMAGE_URL = _closed(["url"], {"url": {"type": "string"}, "detail": {"type": "string"}})
_IMAGE = _part("image_url", _IMAGE_URL)
_VIDEO = _part("video_url", _URL)
_AUDIO_URL = _part("audio_url", _URL)
_INPUT_AUDIO = _part(
    "input_audio",
    _closed(
        ["data", "format"], {"data": {"type": "string", "contentEncoding": "base64"}, "format": {"type": "string"}}
    ),
)
MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT, _IMAGE, _VIDEO, _AUDIO_URL, _INPUT_AUDIO]}},
            ]
        },
    },
}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "stream": {"type": "boolean"},
    "seed": {"type": "integer"},
}
CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "maxLength": MAX_ID},
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        **_SAMPLING,
    },
}
COMPLETION = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {"model": {"type": "string", "maxLength": MAX_ID}, "prompt": {"type": "string"}, **_SAMPLING},
}
IMAGES = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": 4000},
        "model": {"type": "string", "maxLength": MAX_ID},
        "n": {"type": "integer", "minimum": 1, "maximum": 4},
        "size": {"type": "string", "maxLength": 16},
        "response_format": {"enum": ["b64_json", "url"]},
        "negative_prompt": {"type": "string", "maxLength": 4000},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 1000},
        "seed": {"type": "integer", "minimum": 0},
        "true_cfg_scale": {"type": "number", "minimum": 0, "maximum": 100},
    },
}
IMAGES_ANSWER = {
    "type": "object",
    "required": ["created", "data"],
    "properties": {"created": {"type": "integer"}, "data": {"type": "array", "items": {"type": "object"}}},
}
ENCODER = {
    "type": "object",
    "required": ["url"],
    "additionalProperties": False,
    "properties": {
        "url": {"type": "string", "maxLength": MAX_URL},
        "proof": {"type": "string", "maxLength": 64},
        "ts": {"type": "integer"},
    },
}
"""eric_epd.common.registration.Registration: proof = hex HMAC-SHA256 of "URL\nTS" under the Erics' key."""


def _answers(ok: dict[str, Any], ok_types: tuple[str, ...] = (JSON,)) -> dict[str, Any]:
    return {
        "200": {"description": "done", "content": {t: {"schema": ok} for t in ok_types}},
        "default": {"description": "an error, named", "content": {JSON: {"schema": ERROR}}},
    }


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any], *types: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": body}}},
        "responses": _answers(ok, types or (JSON,)),
    }


def gateway_openapi(version: str) -> dict[str, Any]:
    """The gateway's OpenAPI document, versioned `version`."""
    listed = {"type": "object", "required": ["encoders"]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "eric-epd gateway", "version": version},
        "paths": {
            "/v1/chat/completions": {
                "post": _post(
                    "OpenAI chat completion; several media items go EPD",
                    CHAT,
                    {"type": "object"},
                    JSON,
                    "text/event-stream",
                )
            },
            "/v1/completions": {
                "post": _post(
                    "OpenAI completion (the plain prefill/decode path)",
                    COMPLETION,
                    {"type": "object"},
                    JSON,
                    "text/event-stream",
                )
            },
            "/v1/images/generations": {
                "post": _post(
                    "OpenAI image generation: text encoder (vLLM pooling), then Geri; 404 when not configured",
                    IMAGES,
                    IMAGES_ANSWER,
                )
            },
            "/v1/images/files/{name}": {
                "get": {
                    "summary": "An image answered as a URL (--image-urls); its name is the capability",
                    "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": _answers({}, ("image/png",)),
                }
            },
            "/v1/models": {"get": {"summary": "The engines' models", "responses": _answers({"type": "object"})}},
            "/health": {"get": {"summary": "The gateway and its encoders", "responses": _answers({"type": "object"})}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": _answers({}, ("text/plain",))}},
            "/admin/encoders": {
                "post": _post(
                    "Register an encoder (admin key, from --register-from, with proof of the Eric key)", ENCODER, listed
                ),
                "delete": _post("Deregister an encoder (admin key, from --register-from)", ENCODER, listed),
            },
        },
    }
