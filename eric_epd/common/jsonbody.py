"""Client JSON bodies parsed within bounds (values, nesting depth, string lengths), each violation a JsonBodyError
naming it; and `clip` for echoing a client's value in an error without echoing all of it."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import orjson

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in a request body (OpenAI chat bodies need about 6)."""
MAX_ID = 256
"""Longest identifier (item id, request id, model name) accepted."""
MAX_URL = 8192
"""Longest fetchable URL (http, https, file) accepted; data: URLs are bounded by the body limit instead."""

MAX_TOKENS = 200_000
"""Most JSON tokens (strings, and the brackets, braces, commas and colons outside them) in one body, counted on the
bytes before any value is built: a chat body with dozens of messages and tool schemas holds a few thousand."""

T = TypeVar("T")
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{,:]')
_PUNCTUATION = (b"[", b"{", b",", b":")
MEMCHR_STRINGS = 4096
"""Strings count_tokens walks one by one (memchr) before it counts a body's tokens by regex instead."""


class JsonBodyError(ValueError):
    """The body is not acceptable JSON (malformed, nested too deeply, of the wrong shape): answer 400."""


def count_tokens(body: bytes, limit: int) -> int:
    """The JSON tokens in `body` (strings; brackets, braces, commas and colons outside them), or more than `limit`
    once they are sure to be more. Nothing is parsed. A body without a backslash has no escaped quote, so its strings
    are found by memchr (bytes.find) and never scanned: a request inlining megabytes of base64 costs microseconds.
    Otherwise an upper bound (bytes.count), then one regex scan stopped at the limit."""
    if b"\\" not in body and (count := _count_unescaped(body, limit)) is not None:
        return count
    upper = sum(body.count(c) for c in _PUNCTUATION) + body.count(b'"') // 2
    if upper <= limit:
        return upper
    count = 0
    for count, _ in enumerate(_TOKEN.finditer(body), 1):  # the count is what is wanted
        if count > limit:
            break
    return count


def _count_unescaped(body: bytes, limit: int) -> int | None:
    """count_tokens for a body without backslashes (every '"' opens or closes a string), or None past
    MEMCHR_STRINGS strings: a body of many small strings is counted in C by the regex instead."""
    count, pos, size = 0, 0, len(body)
    for _ in range(MEMCHR_STRINGS):
        opening = body.find(b'"', pos)
        end = size if opening < 0 else opening
        count += sum(body.count(c, pos, end) for c in _PUNCTUATION)
        if opening < 0 or count > limit:
            return count
        closing = body.find(b'"', opening + 1)
        count += 1
        if closing < 0:  # unterminated: the parse refuses it
            return count
        pos = closing + 1
    return None


def _check_tokens(body: bytes, limit: int) -> None:
    if count_tokens(body, limit) > limit:
        raise JsonBodyError(f"JSON body holds more than {limit} tokens (strings, brackets, commas, colons), the limit")


def parse_json(body: bytes, max_depth: int = MAX_DEPTH, max_tokens: int = MAX_TOKENS) -> Any:
    """The parsed body, refused if malformed, holding more than `max_tokens` tokens (counted before parsing) or
    nested deeper than `max_depth` (orjson never recurses in Python)."""
    _check_tokens(body, max_tokens)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):  # orjson stops at 1024 levels
            raise JsonBodyError(f"JSON body nested deeper than {max_depth} levels") from e
        raise JsonBodyError(f"malformed JSON body: {e}") from e
    check_depth(data, max_depth)
    return data


def check_depth(data: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed value nested deeper than `max_depth`, walked without recursion."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise JsonBodyError(f"JSON body nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def decode_struct(body: bytes, kind: type[T]) -> T:
    """`body` decoded into the msgspec type `kind` (whose Meta bounds the fields); its errors as JsonBodyError."""
    _check_tokens(body, MAX_TOKENS)
    try:
        return msgspec.json.decode(body, type=kind)
    except RecursionError as e:
        raise JsonBodyError("JSON body nested too deeply") from e
    except msgspec.DecodeError as e:  # ValidationError included: it names the field
        raise JsonBodyError(f"invalid {getattr(kind, '__name__', 'request')} body: {clip(str(e), 300)}") from e


def clip(value: Any, limit: int = 80) -> str:
    """repr of a client's value, cut to `limit` characters with the full length stated."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
