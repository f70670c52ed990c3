"""Client JSON bodies bounded before they are built (eric_epd.common.jsonbody): tokens counted on the bytes (exactly
as counted on the parsed value, with strings holding every structural character), a body of millions of empty
arrays refused without building one, and the bound's edge."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from eric_epd.common.jsonbody import MAX_TOKENS, MEMCHR_STRINGS, JsonBodyError, count_tokens, parse_json


def _tokens(value: object) -> int:
    """The tokens json.dumps(value) holds, counted on the parsed value (not on its bytes): strings (keys too), an
    opening bracket per container, a comma between siblings and a colon per key."""
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        return 1 + max(len(value) - 1, 0) + sum(_tokens(v) for v in value)
    if isinstance(value, dict):
        return 1 + max(len(value) - 1, 0) + sum(2 + _tokens(v) for v in value.values())
    return 0


def _random(rng: random.Random, depth: int = 0, alphabet: str = 'ab,:[]{}"\\ é') -> object:
    kind = rng.choice("slndab" if depth < 4 else "snb")
    if kind == "s":
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
    if kind == "n":
        return rng.choice([0, -1.5, 3e10, None])
    if kind == "b":
        return rng.random() < 0.5
    if kind in "la":
        return [_random(rng, depth + 1, alphabet) for _ in range(rng.randrange(4))]
    return {f"k{i},:{{[": _random(rng, depth + 1, alphabet) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(40))
def test_tokens_are_counted_exactly_on_the_bytes(seed: int) -> None:
    value = _random(random.Random(seed))
    body = json.dumps(value, ensure_ascii=seed % 2 == 0, indent=None if seed % 3 else 1).encode()
    expected = _tokens(value)
    assert count_tokens(body, expected) <= expected  # a body with exactly the limit's tokens passes
    assert count_tokens(body, expected - 1) > expected - 1  # one token fewer allowed refuses it


@pytest.mark.parametrize("seed", range(40))
def test_tokens_of_bodies_without_escapes_are_counted_exactly(seed: int) -> None:
    """Without a backslash in the body (no escaped quote) strings are skipped by memchr: the same exact count."""
    value = _random(random.Random(seed), alphabet="ab,:[]{} é")
    body = json.dumps(value, ensure_ascii=False, indent=None if seed % 3 else 1).encode()
    assert b"\\" not in body
    expected = _tokens(value)
    assert count_tokens(body, expected) <= expected
    assert count_tokens(body, expected - 1) > expected - 1


def test_megabytes_of_inlined_base64_are_a_few_tokens() -> None:
    payload = "A" * (3 << 20)
    items = [{"id": str(i), "modality": "image", "url": f"data:image/png;base64,{payload}"} for i in range(3)]
    body = json.dumps({"items": items}).encode()
    assert count_tokens(body, MAX_TOKENS) == _tokens({"items": items}) == 42


def test_many_small_strings_are_counted_by_the_regex_exactly() -> None:
    """Past MEMCHR_STRINGS strings the walk hands over to the regex, with the same count."""
    value = [f"s{i}" for i in range(3 * MEMCHR_STRINGS)] + [{"k": ["a", "b"]}]
    body = json.dumps(value).encode()
    expected = _tokens(value)
    assert count_tokens(body, expected) == expected
    assert count_tokens(body, expected - 1) > expected - 1


def test_a_body_of_empty_arrays_is_refused_before_it_is_built() -> None:
    body = b"[" + b"[]," * (8 << 20) + b"[]]"  # 24 MiB, 8 million values: 3 GB of lists when it was parsed
    tracemalloc.start()
    try:
        with pytest.raises(JsonBodyError, match=f"more than {MAX_TOKENS} tokens"):
            parse_json(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_the_bound_is_exact_at_its_edge() -> None:
    at = json.dumps([0] * MAX_TOKENS).encode()  # one bracket and MAX_TOKENS - 1 commas
    assert len(parse_json(at)) == MAX_TOKENS
    with pytest.raises(JsonBodyError, match="tokens"):
        parse_json(json.dumps([0] * (MAX_TOKENS + 1)).encode())
    big_string = json.dumps({"text": "a, [b]: {c}" * 100_000}).encode()  # structure inside a string is no token
    assert parse_json(big_string)["text"].startswith("a, [b]")
