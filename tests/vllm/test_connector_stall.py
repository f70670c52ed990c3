"""A stalled Eric delays only the requests whose items it holds: vLLM's loop never waits on Eric, so text-only
streams on the same engine keep their pace (real vLLM serve with the Eric connector, real Erics, openai client)."""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import threading
import time

import httpx
import openai

from eric_epd.testing.exactness import (
    NEAR_TIE_FLOAT32,
    Greedy,
    assert_greedy_agree,
    assert_greedy_differ,
    greedy_of_openai,
)
from eric_epd.testing.media import image_data_url
from eric_epd.wire.handoff import handles_xargs

STALL_S = 5.0
TEXT = [{"role": "user", "content": "Count slowly from one to one hundred."}]


def _client(vllm) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=vllm.url + "/v1", api_key=vllm.api_key, max_retries=0, timeout=120)
    return client, client.models.list().data[0].id


def _stream_times(client: openai.OpenAI, model: str, tokens: int = 48) -> list[float]:
    """Arrival time of each streamed chunk of a greedy text-only answer."""
    times = []
    stream = client.chat.completions.create(
        model=model, messages=TEXT, max_tokens=tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            times.append(time.monotonic())
    return times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _encode(eric, url: str) -> dict:
    resp = httpx.post(
        eric.url + "/v1/encode", headers=eric.headers, timeout=60, json={"items": [{"modality": "image", "url": url}]}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["items"][0]


def _ask(client: openai.OpenAI, model: str, part: dict, extra: dict) -> tuple[str, Greedy]:
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, **extra},
    )
    choice = resp.choices[0]
    return choice.finish_reason, greedy_of_openai(choice)


def _epd(client: openai.OpenAI, model: str, item: dict) -> tuple[str, Greedy]:
    """An EPD request as the gateway sends it: a metadata-only item named by its hash, its handle beside it."""
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": item["grid_thw"]}, "uuid": item["hash"]}
    return _ask(client, model, part, {"vllm_xargs": handles_xargs([item["handle"]])})


def test_stalled_eric_delays_only_its_own_requests(vllm_behind_erics) -> None:
    eric, vllm = vllm_behind_erics["erics"][1], vllm_behind_erics["vllm"]
    client, model = _client(vllm)
    image = image_data_url(88, 64, seed=78)
    reference = _ask(client, model, {"type": "image_url", "image_url": {"url": image}}, {})  # vLLM's own encoder
    assert reference[0] == "length" and len(reference[1].tokens) == 6
    other = image_data_url(88, 64, seed=178)  # the negative control's: the same size, other pixels
    wrong = _ask(client, model, {"type": "image_url", "image_url": {"url": other}}, {})
    _stream_times(client, model, 8)  # warm-up
    calm = _gaps(_stream_times(client, model))

    item = _encode(eric, image)
    outcome: dict = {}

    def held() -> None:
        sent = time.monotonic()
        outcome["answer"] = _epd(client, model, item)
        outcome["waited"] = time.monotonic() - sent

    os.kill(eric.proc.pid, signal.SIGSTOP)  # Eric's router: the item's acknowledgement cannot complete
    stopped = time.monotonic()
    try:
        waiter = threading.Thread(target=held)
        waiter.start()
        time.sleep(0.3)  # the EPD request is waiting for its item
        during = _stream_times(client, model)
        text_done = time.monotonic()
        time.sleep(max(0.0, STALL_S - (time.monotonic() - stopped)))
    finally:
        os.kill(eric.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    waiter.join(timeout=120)

    assert outcome["answer"][0] == "length"  # token-exact with vLLM's own encoder up to the first near tie
    assert_greedy_agree(outcome["answer"][1], reference[1], NEAR_TIE_FLOAT32)
    assert_greedy_differ(outcome["answer"][1], wrong[1], NEAR_TIE_FLOAT32, "the held answer against another image's")
    assert outcome["waited"] >= resumed - stopped - 0.3 - 0.05  # the EPD request really waited for the stall
    assert text_done < resumed  # the text stream ran to its end while Eric was stopped
    stalled_gaps = _gaps(during)
    # pace relative to the calm run: the median gap at most doubles, the worst gap stays far below the stall
    assert statistics.median(stalled_gaps) <= 2 * statistics.median(calm) + 0.02, (calm, stalled_gaps)
    assert max(stalled_gaps) < 0.25 * STALL_S, stalled_gaps
    assert httpx.get(eric.url + "/health", timeout=10).status_code == 200
