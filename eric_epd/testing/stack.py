"""Test helpers for a running local stack: chat messages with images, a greedy openai call, the gateway's path
counters. The launchers themselves are in eric_epd.stack."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eric_epd.testing.exactness import Greedy, greedy_of_openai
from eric_epd.testing.lookahead import Cpus, Launched

if TYPE_CHECKING:
    from eric_epd.stack.servers import GatewayServer


def user_turn(urls: list[str], text: str) -> dict:
    """A user message: these image URLs, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def image_messages(urls: list[str], text: str = "Describe what you see.") -> list[dict]:
    """One user turn with these image URLs, then the text."""
    return [user_turn(urls, text)]


def ask(
    base_url: str,
    msgs: list[dict],
    key: str = "unused",
    max_tokens: int = 10,
    raw: bool = False,
    extra: dict | None = None,
    **kw,
):  # -> ChatCompletion, or its raw response (headers and all) with `raw`
    """A greedy chat completion through the official openai client (EOS ignored: fixed length); `extra` adds
    fields of vLLM's own to the body."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    completions = client.chat.completions.with_raw_response if raw else client.chat.completions
    return completions.create(
        model=model,
        messages=msgs,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True, **(extra or {})},
        **kw,
    )


def ask_greedy(
    base_url: str, msgs: list[dict], key: str = "unused", max_tokens: int = 10, stream: bool = False
) -> Greedy:
    """ask() with each step's two best logprobs (streamed: gathered from the chunks): a run to compare with
    exactness.assert_greedy_agree."""
    answer = ask(base_url, msgs, key=key, max_tokens=max_tokens, logprobs=True, top_logprobs=2, stream=stream)
    if not stream:
        return greedy_of_openai(answer.choices[0])
    steps = [
        step
        for chunk in answer
        if chunk.choices and chunk.choices[0].logprobs
        for step in chunk.choices[0].logprobs.content or []
    ]
    return Greedy.of_steps([s.token for s in steps], [[c.logprob for c in s.top_logprobs] for s in steps])


def ask_token_ids(
    base_url: str, msgs: list[dict], key: str = "unused", max_tokens: int = 10, extra: dict | None = None
) -> tuple[Greedy, str | None]:
    """ask_greedy by token ids (vLLM's `return_token_ids`), and the path the gateway took (its `x-epd-path`
    header; None from an engine asked directly); `extra` adds fields of vLLM's own (e.g. `vllm_xargs`)."""
    answer = ask(
        base_url,
        msgs,
        key=key,
        max_tokens=max_tokens,
        raw=True,
        extra={"return_token_ids": True, **(extra or {})},
        logprobs=True,
        top_logprobs=2,
    )
    return greedy_of_openai(answer.parse().choices[0]), answer.headers.get("x-epd-path")


def gateway_paths(gateway: GatewayServer) -> dict[str, float]:
    """gateway_requests_total by path (epd, pd, fallback), read with the gateway's metrics key."""
    import re

    import httpx

    response = httpx.get(gateway.url + "/metrics", headers=gateway.metrics_headers, timeout=10)
    response.raise_for_status()
    text = response.text
    pattern = r'^gateway_requests_total\{path="(\w+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def colocated_epd(
    model: Path,
    logs: Path,
    dtype: str = "float32",
    eric_cpus: Cpus | None = None,
    engine_cpus: Cpus | None = None,
    media_hosts: tuple[str, ...] = (),
    gateway_cpus: Cpus | None = None,
) -> Launched:
    """One Eric, one `vllm serve` behind it (both in `dtype`) and the gateway in front (EPD, or colocated raw media),
    keys wired, not yet launched; its value is {"eric", "vllm", "gateway"}. Eric runs on `eric_cpus`, vLLM on
    `engine_cpus` (default: the halves of host_split()), the gateway on `gateway_cpus` (default: Eric's); Eric and
    the gateway fetch media from `media_hosts` besides public addresses."""
    from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe

    eric = EricServer(
        model, log_path=logs / "eric.log", extra_args=("--dtype", dtype), cpus=eric_cpus, media_hosts=media_hosts
    )
    vllm = VllmServe(
        model, logs / "vllm.log", eric_urls=[eric.url], eric_api_key=eric.api_key, dtype=dtype, cpus=engine_cpus
    )
    gateway = GatewayServer(
        logs / "gateway.log",
        "--encoder-urls",
        eric.url,
        "--colocated-urls",
        vllm.url,
        eric_api_key=eric.api_key,
        upstream_api_key=vllm.api_key,
        cpus=gateway_cpus or eric_cpus,
        media_hosts=media_hosts,
    )
    return Launched((eric, vllm, gateway), {"eric": eric, "vllm": vllm, "gateway": gateway})


@contextlib.contextmanager
def colocated_epd_stack(model: Path, logs: Path, dtype: str = "float32") -> Iterator[dict[str, Any]]:
    """colocated_epd's servers started together; yields {"eric", "vllm", "gateway"} and stops them all."""
    from eric_epd.stack.process import running

    launched = colocated_epd(model, logs, dtype)
    with running(*launched.servers):
        yield launched.value


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """The sum of a server's Prometheus series `name` (with any labels, or those written in `name`) at `url`, read
    with `headers` (a gateway's metrics_headers)."""
    import httpx

    response = httpx.get(url + "/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    text = response.text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0, period_s: float = 0.2) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(period_s)
    return False


def unkeyed_answers(url: str, headers: dict[str, str]) -> dict[tuple[str, str], int]:
    """Every route a server's OpenAPI description lists (read with its key), asked once without the key: the status
    of each (method, path), path parameters filled with a placeholder."""
    import httpx

    spec = httpx.get(url + "/openapi.json", headers=headers, timeout=30)
    assert spec.status_code == 200, spec.text
    answers = {}
    for path, methods in spec.json()["paths"].items():
        concrete = re.sub(r"\{[^}]*\}", "x", path)
        for method in methods:
            if method in ("get", "post", "put", "delete", "patch"):
                resp = httpx.request(method.upper(), url + concrete, json={}, timeout=30)
                answers[(method.upper(), path)] = resp.status_code
    return answers
