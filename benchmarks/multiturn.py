"""Multi-turn chats for benchmarks/epd_vs_colocated.py: conversations of three turns, each resending every earlier
image, driven with the openai client (`vllm bench serve` sends single-turn prompts only: its conversation datasets
keep the first turn), one turn of every conversation at a time; per turn the TTFT p50 and what the turn cost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import metric, user_turn

SHAPES = {"two_images_first": (2, 0, 1), "one_image_first": (1, 0, 1)}
"""New images per turn. One image first: turns 1 and 2 take the gateway's PD path (fewer than --epd-min-items), turn
3 its EPD path, where the first image is named by Eric's hash instead of vLLM's own."""
QUESTIONS = (
    " ".join(["Describe every colour, shape and texture in these pictures, one after the other."] * 3),
    "Which of them is the brightest, and why?",
    "And the new one, compared with the others?",
)
COUNTERS = {
    "eric_encoded": ("eric", 'eric_items_total{modality="image",source="encoded"}'),
    "eric_cached": ("eric", 'eric_items_total{modality="image",source="cached"}'),
    "eric_alias_hits": ("eric", 'eric_alias_hits_total{modality="image"}'),
    "loaded_items": ("vllm", "vllm:eric_ec_loaded_items_total"),
    "loaded_bytes": ("vllm", "vllm:eric_ec_loaded_bytes_total"),
    "prefix_hit_tokens": ("vllm", "vllm:prefix_cache_hits_total"),
}
"""What a turn cost, by server: Eric's encodes and content-cache answers (those found by their raw bytes, not
decoded again: eric_alias_hits), the connector's loads (transfers), the
prompt tokens vLLM's prefix cache computed. A server a side lacks (Eric, colocated) is left out."""
SETTLE_S = 1.0
"""vLLM reports its connector's counters a step after the work: wait this long before reading them."""


@dataclass(frozen=True)
class Load:
    """The conversations of one shape: how many, how many at a time, their answers' length and images' sides."""

    conversations: int
    concurrency: int
    output_tokens: int
    sides: tuple[int, ...] = (224, 448)


def new_images(shape: tuple[int, ...], conversation: int, turn: int, seed: int, sides: tuple[int, ...]) -> list[str]:
    """The images `turn` of `conversation` adds (data URLs), distinct across conversations, turns and seeds."""
    first = sum(shape[:turn])
    return [
        image_data_url(
            sides[(first + i) % len(sides)],
            sides[(first + i) % len(sides)],
            seed=seed * 1_000_003 + conversation * 101 + first + i,
        )
        for i in range(shape[turn])
    ]


def stream_turn(client, model: str, msgs: list[dict], max_tokens: int) -> tuple[float, str]:
    """One streamed greedy answer (EOS ignored: fixed length): seconds to its first token, and its text."""
    start = time.perf_counter()
    ttft, parts = None, []
    for chunk in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
    assert ttft is not None, "an answer without text"
    return ttft, "".join(parts)


def read_counters(servers: dict[str, str]) -> dict[str, float]:
    """The COUNTERS of the servers this side has (`servers`: role -> base URL)."""
    return {name: metric(servers[role], series) for name, (role, series) in COUNTERS.items() if role in servers}


def run_shape(
    base_url: str, key: str, servers: dict[str, str], shape: tuple[int, ...], load: Load, seed: int
) -> dict[str, dict[str, float]]:
    """Every conversation's turn 1, then every turn 2, then every turn 3 (`load.concurrency` at a time): per turn
    the TTFT p50 and p99 (ms), the images it added, and the counters' growth over the turn."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    histories: list[list[dict]] = [[] for _ in range(load.conversations)]

    def one(conversation: int, turn: int) -> float:
        history = histories[conversation]
        history.append(user_turn(new_images(shape, conversation, turn, seed, load.sides), QUESTIONS[turn]))
        ttft, text = stream_turn(client, model, history, load.output_tokens)
        history.append({"role": "assistant", "content": text})
        return ttft

    turns = {}
    for turn in range(len(shape)):
        before = read_counters(servers)
        with ThreadPoolExecutor(load.concurrency) as pool:
            ttfts = sorted(pool.map(lambda c, t=turn: one(c, t), range(load.conversations)))
        time.sleep(SETTLE_S)
        after = read_counters(servers)
        turns[f"turn{turn + 1}"] = {
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * ttfts[int(0.99 * (len(ttfts) - 1))],
            "new_images": shape[turn] * load.conversations,
            **{k: after[k] - before[k] for k in after},
        }
    return turns


def driver(load: Load, warmup: Load) -> Callable[[str, str, dict[str, str], int], dict]:
    """The series' run: a warm-up conversation set (its own images), then every shape; result by shape and turn."""

    def run(base_url: str, key: str, servers: dict[str, str], seed: int) -> dict:
        run_shape(base_url, key, servers, SHAPES["two_images_first"], warmup, seed=100 * seed)
        return {
            name: run_shape(base_url, key, servers, shape, load, seed=100 * seed + k + 1)  # images of its own
            for k, (name, shape) in enumerate(SHAPES.items())
        }

    return run


def print_turns(name: str, sides: dict) -> None:
    """The per-turn table of a multi-turn series: TTFT p50 and prefix-cache hits of both sides, and what each EPD
    turn cost Eric (encodes, content-cache answers) and the connector (items loaded)."""
    cols = (
        ("colocated", "ttft_p50_ms"),
        ("colocated", "prefix_hit_tokens"),
        ("epd", "ttft_p50_ms"),
        ("epd", "prefix_hit_tokens"),
        ("epd", "eric_encoded"),
        ("epd", "eric_cached"),
        ("epd", "eric_alias_hits"),
        ("epd", "loaded_items"),
    )
    lines = [f"{'series':10} {'shape':17} {'turn':5} {'new':>4} " + " ".join(f"{s[:3]}:{c:>17}" for s, c in cols)]
    for shape, turns in sides["epd"]["turns"].items():
        for turn, epd in turns.items():
            row = {"epd": epd, "colocated": sides["colocated"]["turns"][shape][turn]}
            lines.append(
                f"{name:10} {shape:17} {turn:5} {epd['new_images']:4d} "
                + " ".join(f"{row[s].get(c, 0):21.0f}" for s, c in cols)
            )
    print("\n".join(lines))
