"""Multi-turn chats through the gateway resend every earlier image each turn. With Eric's content cache
(--keep-acked-bytes) a resent image is never encoded again, and where vLLM already holds it (its prefix cache covers
the image's tokens, or its encoder cache still has the rows) the connector fetches nothing: per turn, Eric encodes
exactly the new images and vLLM loads exactly the images it does not hold. Each turn's answer equals vLLM's own (its
encoder on the raw images) for the same conversation, token for token up to a near tie."""

from __future__ import annotations

import base64
import io
import itertools
from pathlib import Path

import pytest
from PIL import Image

from eric_epd.stack.process import start_all, stop_all
from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ, greedy_of_openai
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import ask, ask_token_ids, image_messages, metric, user_turn, wait_for

KEY = "sk-multiturn"
COUNTERS = {
    "encoded": ("eric", 'eric_items_total{modality="image",source="encoded"}'),  # Eric's tower encoded them
    "cached": ("eric", 'eric_items_total{modality="image",source="cached"}'),  # from Eric's content cache
    "batches": ("eric", "eric_batches_total"),
    "loaded": ("vllm", "vllm:eric_ec_loaded_items_total"),  # fetched from Eric into vLLM's encoder cache
    "released": ("vllm", "vllm:eric_ec_released_items_total"),  # leases given back unused: vLLM held the item
    "prefix_hits": ("vllm", "vllm:prefix_cache_hits_total"),  # prompt tokens vLLM's prefix cache computed
}
LONG = " ".join(["Describe every colour, shape and texture in these pictures, one after the other."] * 5)
"""Turn 1's text: the prompt spans two of vLLM's 128-token CPU blocks past the images, so the next turn's prefix-cache
hit covers both images."""
FILL_REQUESTS, FILL_SIDE = 9, 224
"""Requests of 4 images of 224 px (64 rows each) that vLLM encodes itself: 2304 rows, more than its encoder cache
holds (2048 rows: max_num_batched_tokens of `vllm serve` on CPU), so everything in it before them is evicted."""


@pytest.fixture(scope="module")
def stack(vllm_behind_erics, qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """The session's first Eric restarted on its address (which vLLM trusts) with a content cache, and a gateway in
    front of it alone; the shared Eric comes back afterwards."""
    erics, vllm, key = vllm_behind_erics["erics"], vllm_behind_erics["vllm"], vllm_behind_erics["eric_key"]
    logs = tmp_path_factory.mktemp("multiturn")
    stop_all(erics[0])
    try:
        with (
            EricServer(
                qwen2_vl_tiny,
                port=erics[0].port,
                api_key=key,
                log_path=logs / "eric.log",
                extra_args=("--keep-acked-bytes", str(64 << 20)),
            ) as eric,
            GatewayServer(
                logs / "gateway.log",
                "--encoder-urls",
                eric.url,
                "--colocated-urls",
                vllm.url,
                "--api-key",
                KEY,
                eric_api_key=key,
                upstream_api_key=vllm.api_key,
            ) as gateway,
        ):
            yield {"eric": eric, "vllm": vllm, "gateway": gateway}
    finally:
        start_all(erics[0])  # the Erics are shared by the session's gateway tests


def counters(stack) -> dict[str, float]:
    return {name: metric(stack[server].url, series) for name, (server, series) in COUNTERS.items()}


def work_since(stack, before: dict[str, float], expect: dict[str, float]) -> dict[str, float]:
    """The counters' growth since `before`, once it matches `expect` (vLLM reports its connector's counters a step
    late) or the wait ends; compared by the caller."""

    def growth() -> dict[str, float]:
        now = counters(stack)
        return {k: now[k] - before[k] for k in now}

    def settled() -> bool:
        work = growth()
        return {k: work[k] for k in expect} == expect

    wait_for(settled, timeout_s=20)
    return growth()


def other_images(msgs: list[dict]) -> list[dict]:
    """`msgs` with each image replaced by another of the same size (the negative control's wrong input)."""
    seeds = itertools.count(90_000)

    def other(part: dict) -> dict:
        if part.get("type") != "image_url":
            return part
        size = Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))).size
        return {"type": "image_url", "image_url": {"url": image_data_url(*size, seed=next(seeds))}}

    return [{**m, "content": [other(p) for p in m["content"]]} if isinstance(m["content"], list) else m for m in msgs]


def epd_turn(stack, msgs: list[dict], expect: dict[str, float], label: str) -> tuple[str, dict[str, float]]:
    """One turn through the gateway (the EPD path): the work it cost is exactly `expect`, and its answer equals vLLM's
    own for the same messages, not vLLM's answer with every image replaced by another of its size. Returns the
    answer's text (the next turn's assistant message) and the work."""
    before = counters(stack)
    raw = ask(
        stack["gateway"].url, msgs, key=KEY, raw=True, extra={"return_token_ids": True}, logprobs=True, top_logprobs=2
    )
    assert raw.headers["x-epd-path"] == "epd", label
    choice = raw.parse().choices[0]
    work = work_since(stack, before, expect)
    assert {k: work[k] for k in expect} == expect, f"{label}: {work}"
    own, _ = ask_token_ids(stack["vllm"].url, msgs, key=stack["vllm"].api_key)
    ours = greedy_of_openai(choice)
    assert_greedy_agree(ours, own, NEAR_TIE_FLOAT32, label)
    wrong, _ = ask_token_ids(stack["vllm"].url, other_images(msgs), key=stack["vllm"].api_key)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, f"{label}, against other images' answer")
    return choice.message.content, work


def evict_encoder_cache(stack, seed: int) -> None:
    """Fill vLLM's encoder cache with images it encodes itself (asked directly), evicting everything older."""
    vllm = stack["vllm"]
    for r in range(FILL_REQUESTS):
        images = [image_data_url(FILL_SIDE, FILL_SIDE, seed=seed + 4 * r + i) for i in range(4)]
        ask(vllm.url, image_messages(images), key=vllm.api_key, max_tokens=1)


def probe_not_in_encoder_cache(stack, images: list[str], label: str) -> None:
    """`images` behind a prefix of their own (`label`: so vLLM's prefix cache cannot cover them): vLLM loads every one
    from Eric, so its encoder cache held none of them; Eric answers them from its content cache."""
    before = counters(stack)
    msgs = [{"role": "system", "content": f"A probe {label}."}, user_turn(images, "Again.")]
    raw = ask(stack["gateway"].url, msgs, key=KEY, raw=True, max_tokens=1)
    assert raw.headers["x-epd-path"] == "epd"
    expect = {"encoded": 0, "cached": len(images), "loaded": len(images), "released": 0}
    work = work_since(stack, before, expect)
    assert {k: work[k] for k in expect} == expect, work


def test_resent_images_in_the_prefix_cache_cost_no_encode_and_no_transfer(stack) -> None:
    """Turn 1 sends two images, turn 2 resends them with a new question, turn 3 adds a third. Before turns 2 and 3
    vLLM's encoder cache is emptied of them (a probe after the turn proves it), so only its prefix cache holds them:
    Eric encodes nothing old (its content cache answers), vLLM loads nothing old (the leases go back unused)."""
    images = [image_data_url(FILL_SIDE, FILL_SIDE, seed=7300 + i) for i in range(3)]
    msgs = [user_turn(images[:2], LONG)]
    answer, _ = epd_turn(stack, msgs, {"encoded": 2, "cached": 0, "batches": 1, "loaded": 2, "released": 0}, "turn 1")
    msgs += [{"role": "assistant", "content": answer}, user_turn([], "Which of the two is brighter?")]
    evict_encoder_cache(stack, seed=73_000)
    answer, work = epd_turn(
        stack, msgs, {"encoded": 0, "cached": 2, "batches": 0, "loaded": 0, "released": 2}, "turn 2"
    )
    assert work["prefix_hits"] > 0
    probe_not_in_encoder_cache(stack, images[:2], "after turn 2")
    msgs += [{"role": "assistant", "content": answer}, user_turn(images[2:], "And this one, compared with both?")]
    evict_encoder_cache(stack, seed=74_000)
    _, work = epd_turn(stack, msgs, {"encoded": 1, "cached": 2, "batches": 1, "loaded": 1, "released": 2}, "turn 3")
    assert work["prefix_hits"] > 0
    probe_not_in_encoder_cache(stack, images[:2], "after turn 3")


def test_resent_images_in_the_encoder_cache_cost_no_encode_and_no_transfer(stack) -> None:
    """Short turns (no prompt fills one of vLLM's 128-token CPU blocks, so its prefix cache holds nothing): the
    resent images come from vLLM's encoder cache, so again Eric encodes only the new image and vLLM loads only it."""
    images = [image_data_url(64 + 16 * i, 72, seed=7400 + i) for i in range(3)]
    msgs = [user_turn(images[:2], "Describe these two pictures.")]
    answer, _ = epd_turn(stack, msgs, {"encoded": 2, "cached": 0, "batches": 1, "loaded": 2, "released": 0}, "turn 1")
    msgs += [{"role": "assistant", "content": answer}, user_turn([], "Which one is brighter?")]
    answer, work = epd_turn(
        stack, msgs, {"encoded": 0, "cached": 2, "batches": 0, "loaded": 0, "released": 2}, "turn 2"
    )
    assert work["prefix_hits"] == 0
    msgs += [{"role": "assistant", "content": answer}, user_turn(images[2:], "And this one?")]
    _, work = epd_turn(stack, msgs, {"encoded": 1, "cached": 2, "batches": 1, "loaded": 1, "released": 2}, "turn 3")
    assert work["prefix_hits"] == 0


def plain_turn(stack, msgs: list[dict], label: str) -> tuple[str, dict[str, float]]:
    """One turn through the gateway that takes the plain path (vLLM encodes its media itself): Eric does no work and
    vLLM loads nothing. Returns the answer's text and the work."""
    before = counters(stack)
    raw = ask(stack["gateway"].url, msgs, key=KEY, raw=True)
    assert raw.headers["x-epd-path"] == "pd", label
    expect = {"encoded": 0, "cached": 0, "batches": 0, "loaded": 0}
    work = work_since(stack, before, expect)
    assert {k: work[k] for k in expect} == expect, f"{label}: {work}"
    return raw.parse().choices[0].message.content, work


def test_a_chat_crossing_the_epd_threshold_keeps_what_vllm_encoded_itself(stack) -> None:
    """Turn 1 sends one image (fewer than --epd-min-items: the plain path, vLLM encodes it under its own hash). Turn 2
    resends it with one new image: only one is new to the engine, so the turn stays plain and vLLM's prefix cache
    covers turn 1's image (no encode anywhere of it, no transfer). Turn 3 adds two new images: two are new, so it goes
    EPD, Eric encoding all four once (the plain turns' images were never Eric's), and answers as vLLM does."""
    images = [image_data_url(FILL_SIDE, FILL_SIDE, seed=7500 + i) for i in range(4)]
    msgs = [user_turn(images[:1], LONG)]
    answer, _ = plain_turn(stack, msgs, "turn 1")
    msgs += [{"role": "assistant", "content": answer}, user_turn(images[1:2], "And this one?")]
    answer, work = plain_turn(stack, msgs, "turn 2")
    assert work["prefix_hits"] > 0  # turn 1's image and text came from vLLM's prefix cache
    msgs += [{"role": "assistant", "content": answer}, user_turn(images[2:], "And these two, compared with both?")]
    epd_turn(stack, msgs, {"encoded": 4, "cached": 0, "batches": 1, "loaded": 4, "released": 0}, "turn 3")
