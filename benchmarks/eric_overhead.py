"""Eric's fixed overhead: a whole encode request against the vision tower's own forward on the same core.

Tiny Qwen2-VL, 3 distinct small JPEGs per request, Eric on one core (`--cpus`), the load on another. Baseline, same
run and core: Eric's encoder module called in-process on the same preprocessed batches (the tower alone). Ours: Eric
over HTTP (aiohttp, one request per JPEG triple, bodies serialized beforehand; at concurrency 1 also through httpx,
whose own CPU adds to the latency), at concurrency 1 (latency) and 8 (images/s). Targets (issue 9): p50
beyond the tower's own compute at most 5 ms; at least 300 images/s at concurrency 8. Eric's per-stage histograms
show where the rest goes. Writes benchmarks/results/eric_overhead.{json,png}.
Usage: python benchmarks/eric_overhead.py [--requests 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import torch

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.eric.decode import decode_image
from eric_epd.media.limits import MediaLimits
from eric_epd.models.registry import load_encoder, load_processor
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import data_url, image_bytes, random_image

logger = logging.getLogger("eric_overhead")
RESULTS = Path(__file__).parent / "results"
IMAGES_PER_REQUEST, SIDE = 3, 64
TARGET_OVERHEAD_MS, TARGET_IMAGES_PER_S = 5.0, 300.0
STAGE_RE = re.compile(r'eric_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)')


def jpeg_requests(n: int, seed: int) -> list[list[bytes]]:
    """n requests of distinct JPEG triples (Eric dedupes by content, so nothing repeats)."""
    return [
        [
            image_bytes(random_image(SIDE, SIDE, seed + IMAGES_PER_REQUEST * i + k), "JPEG")
            for k in range(IMAGES_PER_REQUEST)
        ]
        for i in range(n)
    ]


def tower_alone(model: Path, requests: list[list[bytes]], core: int) -> list[float]:
    """Seconds of Eric's encoder forward per request's batch, in this process on `core` (one torch thread)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    processor, encoder = load_processor(model), load_encoder(model, torch.float32, "cpu")
    limits, out = MediaLimits(), []
    for jpegs in requests:
        items = [processor.process_image(decode_image(j, limits)) for j in jpegs]
        pixels = torch.from_numpy(np.concatenate([i.float_pixels() for i in items]))
        grid = torch.tensor([list(i.grid_thw) for i in items])
        start = time.perf_counter()
        with torch.inference_mode():
            encoder(pixels, grid)
        out.append(time.perf_counter() - start)
    return out


async def load(
    eric: EricServer, requests: list[list[bytes]], concurrency: int, client: str = "aiohttp"
) -> tuple[list[float], float]:
    """Latency of each request and the wall time of all of them, `concurrency` at a time. The bodies are serialized
    before the clock starts; `client` is the HTTP client library ("aiohttp", "httpx"): its own CPU lands in the
    latency, since the tower-alone baseline has no client at all."""
    bodies = iter(
        [
            json.dumps({"items": [{"modality": "image", "url": data_url(j, "image/jpeg")} for j in jpegs]}).encode()
            for jpegs in requests
        ]
    )
    latencies: list[float] = []
    headers = {**eric.headers, "content-type": "application/json"}
    url = eric.url + "/v1/encode"
    if client == "httpx":
        session: Any = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency))

        async def post(body: bytes) -> None:
            (await session.post(url, content=body, headers=headers)).raise_for_status()
    else:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

        async def post(body: bytes) -> None:
            async with session.post(url, data=body, headers=headers) as resp:
                resp.raise_for_status()
                await resp.read()

    async with session:

        async def worker() -> None:
            for body in bodies:
                start = time.perf_counter()
                await post(body)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


def stage_sums(eric: EricServer) -> dict[str, float]:
    """The stage sums of eric_stage_seconds from the Eric's /metrics."""
    text = httpx.get(eric.url + "/metrics", timeout=10).text
    return {stage: float(v) for kind, stage, v in STAGE_RE.findall(text) if kind == "sum"}


def run_eric(model: Path, args: argparse.Namespace) -> dict:
    """Eric's latency at concurrency 1, images/s at 8 and stage times per request, over `args.rounds` rounds."""
    os.sched_setaffinity(0, {args.client_core})
    out: dict = {"c1_latency_s": [], "c1_latency_httpx_s": [], "c8_images_per_s": [], "stages_ms_per_request": {}}
    with EricServer(model, cpus=(args.eric_core,), log_path=RESULTS / "eric_overhead_eric.log") as eric:
        asyncio.run(load(eric, jpeg_requests(100, 10_000_000), 8))  # warm-up
        for r in range(args.rounds):
            before = stage_sums(eric)
            lat, _ = asyncio.run(load(eric, jpeg_requests(args.requests, 20_000_000 * (r + 1)), 1))
            after = stage_sums(eric)
            out["c1_latency_s"] += lat
            for stage, total in after.items():
                per = (total - before.get(stage, 0.0)) * 1e3 / len(lat)
                out["stages_ms_per_request"].setdefault(stage, []).append(per)
            lat_httpx, _ = asyncio.run(load(eric, jpeg_requests(args.requests, 25_000_000 * (r + 1)), 1, "httpx"))
            out["c1_latency_httpx_s"] += lat_httpx
            lat8, wall = asyncio.run(load(eric, jpeg_requests(args.requests, 30_000_000 * (r + 1)), 8))
            out["c8_images_per_s"].append(len(lat8) * IMAGES_PER_REQUEST / wall)
    return out


def plot(results: dict, path: Path) -> None:
    """The latency histograms of Eric and the tower alone, and Eric's stage times, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist(np.array(results["eric"]["c1_latency_s"]) * 1e3, bins=60, alpha=0.6, label="Eric request (HTTP)")
    a.hist(np.array(results["tower_s"]) * 1e3, bins=60, alpha=0.6, label="tower forward alone")
    a.set_xlabel("ms per request of 3 JPEGs (concurrency 1)")
    a.set_title(f"p50 overhead {results['overhead_p50_ms']:.2f} ms (target <= {TARGET_OVERHEAD_MS:g})")
    a.legend()
    stages = {k: float(np.median(v)) for k, v in results["eric"]["stages_ms_per_request"].items()}
    b.barh(list(stages), list(stages.values()))
    b.set_xlabel("ms per request (median of rounds)")
    b.set_title(f"Eric stages; {results['c8_images_per_s']:.0f} img/s at concurrency 8")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Measure the tower alone and then Eric on the same core, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500, help="requests per round and concurrency")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds (medians reported)")
    ap.add_argument("--eric-core", type=int, default=0, help="CPU core for Eric")
    ap.add_argument("--client-core", type=int, default=1, help="CPU core for the load generator")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    RESULTS.mkdir(exist_ok=True)
    model = ensure_checkpoint("qwen2_vl", "tiny")
    tower = tower_alone(model, jpeg_requests(args.requests, 40_000_000), args.eric_core)
    eric = run_eric(model, args)
    tower_p50, eric_p50 = float(np.median(tower)) * 1e3, float(np.median(eric["c1_latency_s"])) * 1e3
    images_per_s = float(np.median(eric["c8_images_per_s"]))
    tower_images_per_s = IMAGES_PER_REQUEST / float(np.median(tower))
    results = {
        "tower_s": tower,
        "eric": eric,
        "tower_p50_ms": tower_p50,
        "eric_p50_ms": eric_p50,
        "eric_p99_ms": float(np.percentile(eric["c1_latency_s"], 99)) * 1e3,
        "overhead_p50_ms": eric_p50 - tower_p50,
        "client": "aiohttp, bodies serialized before timing",
        "overhead_p50_ms_httpx_client": float(np.median(eric["c1_latency_httpx_s"])) * 1e3 - tower_p50,
        "c8_images_per_s": images_per_s,
        "tower_images_per_s": tower_images_per_s,
        "images_per_s_ratio": images_per_s / tower_images_per_s,
        "targets": {"overhead_p50_ms": TARGET_OVERHEAD_MS, "c8_images_per_s": TARGET_IMAGES_PER_S},
    }
    (RESULTS / "eric_overhead.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "eric_overhead.png")
    stages = ", ".join(f"{k} {np.median(v):.2f}" for k, v in sorted(eric["stages_ms_per_request"].items()))
    logger.info(
        "results\n%-28s %10s %10s %8s\n%-28s %10.2f %10.0f\n%-28s %10.2f %10.0f %8.2f\n"
        "overhead p50 %.2f ms (target <= %g), p99 of Eric %.2f ms; img/s at concurrency 8: %.0f "
        "(target >= %g)\nEric stages, ms per request: %s",
        "",
        "p50 ms",
        "img/s",
        "ratio",
        "tower alone (in-process)",
        tower_p50,
        tower_images_per_s,
        "Eric (HTTP, c1 ms / c8 img/s)",
        eric_p50,
        images_per_s,
        results["images_per_s_ratio"],
        results["overhead_p50_ms"],
        TARGET_OVERHEAD_MS,
        results["eric_p99_ms"],
        images_per_s,
        TARGET_IMAGES_PER_S,
        stages,
    )


if __name__ == "__main__":
    main()
