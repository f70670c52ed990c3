"""Eric's throughput-latency frontier on one device share: `/v1/encode` at rising client concurrency, each request
carrying the traffic mix's images (fresh ones, so Eric's content cache never answers); at each point, what an item
cost on the host (the router's stages) and in the vision tower, from Eric's eric_stage_seconds histogram."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from itertools import count

import httpx
import msgspec
import numpy as np

from eric_epd.common.prometheus import scrape, totals, totals_by_label
from eric_epd.media.synthetic import image_data_url
from eric_epd.planning.profiles import EricPoint, Traffic
from eric_epd.planning.servers import Endpoint

logger = logging.getLogger(__name__)

HOST_STAGES = ("body_read", "fetch", "decode", "preprocess", "hash", "answer")
"""The stages of eric_stage_seconds{stage} that are host work on Eric's router: reading the request body, fetching
each item (a data URL's base64; a download's wait too, where a URL is remote), decoding, preprocessing and hashing
it, and writing the JSON answer. Left out: pool_reserve and engine_queue (waits for room in the pool and for the
engine, not work) and pool_write (the engine's copy of a batch's output into the pool). The router's untimed work
(HTTP framing, messages to the engine) is not in any stage, so the host figure is a floor of its work; where the
tower runs on the same cores (CPU shares), the stages' wall times include waiting for them."""
TOWER_STAGES = ("batch_compute",)
"""The stages that are the vision tower: rank 0's forward of each executed batch (wall time: with tensor
parallelism, every rank's device is busy for it)."""


class HostTowerSplit(msgspec.Struct, frozen=True):
    """Seconds per item on the host (HOST_STAGES summed) and in the tower (TOWER_STAGES) between two scrapes, over
    the items that arrived between them (one `fetch` observation each), with each stage's share per item."""

    items: float
    host_s_per_item: float
    tower_s_per_item: float
    stages_s_per_item: dict[str, float]


def host_tower_split(before: str, after: str) -> HostTowerSplit:
    """The split from two scrapes of Eric's /metrics (Prometheus text), taken around some load; all zero where no
    item arrived between them."""
    name, label = "eric_stage_seconds", "stage"
    old, new = totals_by_label(before, name, label), totals_by_label(after, name, label)
    gained = {s: new.get(s, (0.0, 0.0))[0] - old.get(s, (0.0, 0.0))[0] for s in (*HOST_STAGES, *TOWER_STAGES)}
    items = new.get("fetch", (0.0, 0.0))[1] - old.get("fetch", (0.0, 0.0))[1]
    if items <= 0:
        return HostTowerSplit(0.0, 0.0, 0.0, dict.fromkeys(gained, 0.0))
    per = {s: seconds / items for s, seconds in gained.items()}
    return HostTowerSplit(items, sum(per[s] for s in HOST_STAGES), sum(per[s] for s in TOWER_STAGES), per)


def image_urls(traffic: Traffic, seeds: Iterator[int]) -> list[str]:
    """One request's images: the mix's sides in turn, each a new random image."""
    return [
        image_data_url(side, side, next(seeds))
        for side in (traffic.sides[i % len(traffic.sides)] for i in range(traffic.images_per_request))
    ]


async def post_all(
    url: str, headers: dict[str, str], bodies: list[dict], concurrency: int
) -> tuple[list[float], float]:
    """POST `bodies` to `url` in order with `concurrency` clients, each failure raised; (latencies, wall seconds)."""
    queue = list(reversed(bodies))
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                t0 = time.perf_counter()
                (await client.post(url, json=body)).raise_for_status()
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def measure_eric(
    eric: Endpoint, traffic: Traffic, concurrencies: tuple[int, ...], requests_per_point: int, seed: int = 0
) -> list[EricPoint]:
    """One point per concurrency (after one warm-up request per side): items/s, latency p50/p99, items per batch,
    and seconds per item on the host and in the tower (host_tower_split)."""
    seeds = count(seed * 1_000_003)
    warm = [
        {"items": [{"modality": "image", "url": u}]} for u in (image_data_url(s, s, next(seeds)) for s in traffic.sides)
    ]
    asyncio.run(post_all(eric.url + "/v1/encode", eric.headers, warm, 1))
    points = []
    for c in concurrencies:
        n = max(requests_per_point, 2 * c)
        bodies = [{"items": [{"modality": "image", "url": u} for u in image_urls(traffic, seeds)]} for _ in range(n)]
        before_text = scrape(eric.url)
        latencies, wall = asyncio.run(post_all(eric.url + "/v1/encode", eric.headers, bodies, c))
        after_text = scrape(eric.url)
        before, after = totals(before_text, "eric_batch_items"), totals(after_text, "eric_batch_items")
        batches = max(after[1] - before[1], 1.0)
        split = host_tower_split(before_text, after_text)
        point = EricPoint(
            concurrency=c,
            items_per_s=n * traffic.images_per_request / wall,
            latency_p50_s=float(np.percentile(latencies, 50)),
            latency_p99_s=float(np.percentile(latencies, 99)),
            batch_items=(after[0] - before[0]) / batches,
            host_s_per_item=split.host_s_per_item,
            tower_s_per_item=split.tower_s_per_item,
        )
        logger.info("Eric at concurrency %d: %s", c, point)
        logger.info(
            "Eric at concurrency %d, ms per item by stage (%d items): %s",
            c,
            split.items,
            ", ".join(f"{s} {v * 1e3:.2f}" for s, v in split.stages_s_per_item.items()),
        )
        points.append(point)
    return points
