"""Eric's throughput-latency frontier on one device share: `/v1/encode` at rising client concurrency, each request
carrying the traffic mix's images (fresh ones, so Eric's content cache never answers)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from itertools import count

import httpx
import numpy as np

from eric_epd.common.prometheus import histogram_totals
from eric_epd.media.synthetic import image_data_url
from eric_epd.planning.profiles import EricPoint, Traffic
from eric_epd.planning.servers import Endpoint

logger = logging.getLogger(__name__)


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
    """One point per concurrency (after one warm-up request per side): items/s, latency p50/p99, items per batch."""
    seeds = count(seed * 1_000_003)
    warm = [
        {"items": [{"modality": "image", "url": u}]} for u in (image_data_url(s, s, next(seeds)) for s in traffic.sides)
    ]
    asyncio.run(post_all(eric.url + "/v1/encode", eric.headers, warm, 1))
    points = []
    for c in concurrencies:
        n = max(requests_per_point, 2 * c)
        bodies = [{"items": [{"modality": "image", "url": u} for u in image_urls(traffic, seeds)]} for _ in range(n)]
        before = histogram_totals(eric.url, "eric_batch_items")
        latencies, wall = asyncio.run(post_all(eric.url + "/v1/encode", eric.headers, bodies, c))
        after = histogram_totals(eric.url, "eric_batch_items")
        batches = max(after[1] - before[1], 1.0)
        point = EricPoint(
            concurrency=c,
            items_per_s=n * traffic.images_per_request / wall,
            latency_p50_s=float(np.percentile(latencies, 50)),
            latency_p99_s=float(np.percentile(latencies, 99)),
            batch_items=(after[0] - before[0]) / batches,
        )
        logger.info("Eric at concurrency %d: %s", c, point)
        points.append(point)
    return points
