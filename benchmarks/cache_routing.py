"""Repeated-image traffic across two Erics: encoder compute per request and TTFT for no cache, a per-Eric content
cache, and the global cache (Mooncake Store) with the gateway's cache-aware routing, same run, same images.

Traffic: chats of 2 images each drawn Zipf(1.1) from a few hundred distinct images, sent by the openai client
(streamed, TTFT = first content token) at a fixed concurrency. Two Erics and the gateway on one half of the cores,
vLLM behind them on the other (its prefix and multimodal caches off, so the encoders' caches are what differs).
Per configuration fresh Erics and gateway; one vLLM for all. Encoder compute: the Erics' summed batch forward time
(eric_stage_seconds{stage="batch_compute"}) per request. Target (issue 13): global + routing at most 0.3x the
encoder compute of no cache, TTFT p50 at most 0.5x. Writes benchmarks/results/cache_routing.{json,png}.
Usage: python benchmarks/cache_routing.py [--images 300] [--requests 200] [--concurrency 4] [--model tiny|small]
       [--side 64] [--out benchmarks/results/cache_routing]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import openai

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.process import free_port, new_key
from eric_epd.stack.servers import EricServer, GatewayServer, StoreMaster, VllmServe, host_split
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages

logger = logging.getLogger("cache_routing")
RESULTS = Path(__file__).parent / "results"
CONFIGS = ("no cache", "per-Eric cache", "global cache + routing")
CACHE_BYTES = 128 << 20


def traffic(images: int, requests: int, side: int, seed: int = 0) -> list[list[str]]:
    """Each request's two image URLs, drawn Zipf(1.1) over `images` distinct images (distinct within a request),
    about `side` pixels a side."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, images + 1) ** 1.1
    weights /= weights.sum()
    urls = [image_data_url(side + 8 * (i % 5), side, seed=10_000 + i) for i in range(images)]
    return [[urls[j] for j in rng.choice(images, size=2, replace=False, p=weights)] for _ in range(requests)]


def items_by_source(eric: EricServer) -> dict[str, float]:
    """Items this Eric answered, by where their embedding came from (encoded, cached, global)."""
    text = httpx.get(eric.url + "/metrics").text
    counts: dict[str, float] = {}
    for source, value in re.findall(r'^eric_items_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', text, re.M):
        counts[source] = counts.get(source, 0.0) + float(value)
    return counts


def total_items(erics: list[EricServer]) -> dict[str, float]:
    """Items the Erics answered, summed over them, by source (encoded, cached, global)."""
    counts: dict[str, float] = {}
    for eric in erics:
        for source, n in items_by_source(eric).items():
            counts[source] = counts.get(source, 0.0) + n
    return counts


def compute_seconds(eric: EricServer) -> float:
    """The Eric's total batch forward time so far (its batch_compute stage sum), from /metrics."""
    text = httpx.get(eric.url + "/metrics").text
    m = re.search(r'^eric_stage_seconds_sum\{stage="batch_compute"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def load(url: str, key: str, model: str, chats: list[list[str]], concurrency: int) -> list[float]:
    """TTFT of every chat (streamed, greedy, 8 tokens)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    queue, ttfts = list(chats), []

    async def worker() -> None:
        while queue:
            images = queue.pop(0)
            start = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model, messages=image_messages(images), max_tokens=8, temperature=0, stream=True
            )
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            ttfts.append(first if first is not None else time.perf_counter() - start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return ttfts


def run_config(
    name: str,
    model: Path,
    vllm: VllmServe,
    key: str,
    ports: list[int],
    chats: list[list[str]],
    concurrency: int,
    logs: Path,
) -> dict:
    """One configuration's run on fresh Erics and gateway: TTFT, encoder compute and encodes per request."""
    eric_cpus = host_split()[0]
    with ExitStack() as stack:
        extra: tuple[str, ...] = ()
        if name != "no cache":
            extra += ("--keep-acked-bytes", str(CACHE_BYTES))
        if name == "global cache + routing":
            master = stack.enter_context(StoreMaster(logs / "master.log"))
            extra += ("--global-cache", master.address, "--global-cache-bytes", str(CACHE_BYTES))
        erics = [
            stack.enter_context(
                EricServer(
                    model,
                    port=port,
                    api_key=key,
                    cpus=eric_cpus,
                    extra_args=extra,
                    log_path=logs / f"{name[:6].strip()}-eric{i}.log",
                )
            )
            for i, port in enumerate(ports)
        ]
        routing = () if name == "global cache + routing" else ("--health-interval", "3600")  # no loads: rendezvous
        gateway = stack.enter_context(
            GatewayServer(
                logs / f"{name[:6].strip()}-gateway.log",
                "--encoder-urls",
                ",".join(e.url for e in erics),
                "--colocated-urls",
                vllm.url,
                *routing,
                api_key="bench",
                eric_api_key=key,
                upstream_api_key=vllm.api_key,
                cpus=eric_cpus,
            )
        )
        asyncio.run(load(gateway.url, "bench", str(model), [chats[0]], 1))  # warm-up outside the count
        before, items_before = sum(compute_seconds(e) for e in erics), total_items(erics)
        start = time.perf_counter()
        ttfts = asyncio.run(load(gateway.url, "bench", str(model), chats, concurrency))
        wall = time.perf_counter() - start
        compute = sum(compute_seconds(e) for e in erics) - before
        items = {k: v - items_before.get(k, 0.0) for k, v in total_items(erics).items()}
    return {
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "encoder_s_per_request": compute / len(chats),
        "encoded_per_request": items.get("encoded", 0) / len(chats),
        "items": items,
        "requests_per_s": len(chats) / wall,
    }


def plot(result: dict, path: Path) -> None:
    """Bar charts of encodes, encoder compute and TTFT p50 per configuration, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric, label in (
        (axes[0], "encoded_per_request", "items encoded per request"),
        (axes[1], "encoder_s_per_request", "encoder compute per request (s)"),
        (axes[2], "ttft_p50_s", "TTFT p50 (s)"),
    ):
        ax.bar(list(rows), [rows[n][metric] for n in rows], color=["gray", "tab:blue", "tab:green"])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=10)
    fig.suptitle(f"Zipf(1.1) over {result['images']} images, {result['requests']} chats of 2 images, 2 Erics")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    """Run the three configurations on one vLLM, print the comparison, and write the JSON and the plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=300, help="distinct images in the workload")
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument(
        "--model",
        choices=("tiny", "small"),
        default="tiny",
        help="built-in checkpoint (small: a heavier vision tower, where the encoder weighs on TTFT)",
    )
    ap.add_argument("--side", type=int, default=64, help="image side in pixels (about)")
    ap.add_argument(
        "--out", type=Path, default=RESULTS / "cache_routing", help="output path stem (.json and .png written)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = ensure_checkpoint("qwen2_vl", args.model)
    logs = args.out.parent / "cache_routing_logs"
    logs.mkdir(parents=True, exist_ok=True)
    chats = traffic(args.images, args.requests, args.side)
    key = new_key()
    ports = [free_port(), free_port()]  # fixed for the run: vLLM trusts these two
    rows = {}
    with VllmServe(
        model,
        logs / "vllm.log",
        eric_urls=[f"http://127.0.0.1:{p}" for p in ports],
        eric_api_key=key,
        extra=("--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"),
    ) as vllm:
        for name in CONFIGS:
            rows[name] = run_config(name, model, vllm, key, ports, chats, args.concurrency, logs)
            logger.info("%s: %s", name, rows[name])
    base = rows["no cache"]
    print(
        f"{'':26} {'encodes/req':>11} {'ratio':>6} {'encoder s/req':>13} {'ratio':>6} {'TTFT p50':>9} "
        f"{'ratio':>6} {'TTFT p99':>9}"
    )
    for name, row in rows.items():
        print(
            f"{name:26} {row['encoded_per_request']:11.3f} "
            f"{row['encoded_per_request'] / max(base['encoded_per_request'], 1e-9):5.2f}x "
            f"{row['encoder_s_per_request']:13.4f} "
            f"{row['encoder_s_per_request'] / max(base['encoder_s_per_request'], 1e-9):5.2f}x "
            f"{row['ttft_p50_s']:9.3f} {row['ttft_p50_s'] / base['ttft_p50_s']:5.2f}x {row['ttft_p99_s']:9.3f}"
        )
    result = {
        "images": args.images,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "model": args.model,
        "side": args.side,
        "rows": rows,
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
