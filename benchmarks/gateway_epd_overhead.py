"""Latency the gateway adds on the EPD path (p50/p99) and its requests/s, against a client making the same two calls.

Same run, same servers: tiny Qwen2-VL, one Eric (core 0) and `vllm serve` with Eric's connector (core 1); the
gateway and this client share --gateway-core (vLLM's by default: idle while Eric encodes). Each request is a chat
with 3 distinct small JPEGs as data URLs (nothing to fetch or inline: the gateway's inlining never runs), 1 output
token. Baseline ("direct"): the client POSTs the images to Eric's /v1/encode, then the chat to vLLM with each image
part as a metadata-only embeds part keyed by Eric's hash and the handles in `vllm_xargs` (what the gateway sends).
Ours: the same chat through the gateway (its path must be "epd"). The two alternate, first one then the other, with
fresh images every request, so neither finds the other's work in a cache. The gateway's own stage and upstream sums
and the direct calls' times show where the difference goes. Writes benchmarks/results/gateway_epd_overhead.{json,png}.
Usage: python benchmarks/gateway_epd_overhead.py [--requests 300] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from gateway_overhead import plot  # a sibling script (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.process import running
from eric_epd.testing.media import data_url, image_bytes, random_image
from eric_epd.testing.stack import colocated_epd, metric
from eric_epd.wire.eric import EncodeItem, decode_answer, encode_body
from eric_epd.wire.handoff import handles_xargs

logger = logging.getLogger("gateway_epd_overhead")
RESULTS = Path(__file__).parent / "results"
IMAGES, SIDE, CONCURRENCY = 3, 64, 8
TARGET_P50_MS = 0.5
"""Issue 51: the gateway adds at most 0.5 ms p50 on the EPD path with inlining off."""


def chat(urls: list[str], model: str) -> dict[str, Any]:
    """A chat asking about `urls` (one user message: the images, then a question), 1 greedy output token."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": "What differs?"})
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1, "temperature": 0.0}


class Images:
    """Fresh JPEG triples as data URLs, never the same pixels twice in a run (Eric and vLLM key by content)."""

    def __init__(self) -> None:
        self._seeds = itertools.count(1000)

    def triple(self) -> list[str]:
        """The next IMAGES images."""
        return [
            data_url(image_bytes(random_image(SIDE, SIDE, next(self._seeds)), "JPEG"), "image/jpeg")
            for _ in range(IMAGES)
        ]


class Direct:
    """The baseline client: Eric's /v1/encode, then vLLM with the answer's embeds parts and handles."""

    def __init__(self, client: httpx.AsyncClient, eric: Any, vllm: Any) -> None:
        self._client, self._eric, self._vllm = client, eric, vllm
        self.calls_s: dict[str, list[float]] = {"encoder": [], "engine": []}
        """Each call's seconds to its whole answer, every request's (what the gateway's upstream times compare to)."""

    async def ask(self, urls: list[str], model: str) -> None:
        """Encode `urls` at Eric, then ask vLLM with Eric's rows (raises on any error status)."""
        body = encode_body([EncodeItem(modality="image", url=u, id=str(i)) for i, u in enumerate(urls)])
        start = time.perf_counter()
        encoded = await self._client.post(
            self._eric.url + "/v1/encode",
            content=body,
            headers={**self._eric.headers, "content-type": "application/json"},
        )
        encoded.raise_for_status()
        self.calls_s["encoder"].append(time.perf_counter() - start)
        items = decode_answer(encoded.content).items
        request = chat(urls, model)
        request["messages"][0]["content"][:IMAGES] = [
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": it.grid_thw}, "uuid": it.hash} for it in items
        ]
        request["vllm_xargs"] = handles_xargs(it.handle for it in items)
        start = time.perf_counter()
        answer = await self._client.post(
            self._vllm.url + "/v1/chat/completions", json=request, headers=self._vllm.headers
        )
        answer.raise_for_status()
        self.calls_s["engine"].append(time.perf_counter() - start)


class ThroughGateway:
    """Ours: the client's chat to the gateway, which must take the EPD path."""

    def __init__(self, client: httpx.AsyncClient, gateway: Any) -> None:
        self._client, self._gateway = client, gateway

    async def ask(self, urls: list[str], model: str) -> None:
        """Ask the gateway (raises on an error status or a path other than EPD)."""
        answer = await self._client.post(
            self._gateway.url + "/v1/chat/completions", json=chat(urls, model), headers=self._gateway.headers
        )
        answer.raise_for_status()
        if answer.headers.get("x-epd-path") != "epd":
            raise RuntimeError(f"the gateway took the {answer.headers.get('x-epd-path')} path, not EPD")


async def latencies(paths: dict[str, Any], model: str, n: int, images: Images) -> dict[str, list[float]]:
    """Seconds per request on each path, alternating which goes first, after 5 warm-up rounds."""
    out: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(5):
        for path in paths.values():
            await path.ask(images.triple(), model)
    names = list(paths)
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            urls = images.triple()
            start = time.perf_counter()
            await paths[name].ask(urls, model)
            out[name].append(time.perf_counter() - start)
    return out


async def throughput(path: Any, model: str, seconds: float, images: Images) -> float:
    """Requests/s on `path` at CONCURRENCY for `seconds` (the images made beforehand, off the clock)."""
    batches = [images.triple() for _ in range(int(seconds * 200))]
    done, deadline = 0, time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline and done < len(batches):
            done += 1
            await path.ask(batches[done - 1], model)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - start)


def gateway_sums(gateway: Any) -> dict[str, float]:
    """The gateway's own sums (seconds): each stage, each upstream's time to headers, and its EPD requests' whole
    latency and count, from its /metrics."""
    text = httpx.get(gateway.url + "/metrics", headers=gateway.metrics_headers, timeout=10).text
    out = {
        f"stage:{k}": float(v) for k, v in re.findall(r'^gateway_stage_seconds_sum\{stage="(\w+)"\} (\S+)$', text, re.M)
    }
    out |= {
        f"upstream:{k}": float(v)
        for k, v in re.findall(r'^gateway_upstream_seconds_sum\{upstream="(\w+)"\} (\S+)$', text, re.M)
    }
    for kind in ("sum", "count"):
        found = re.search(rf'^gateway_request_seconds_{kind}\{{path="epd"\}} (\S+)$', text, re.M)
        out[f"epd_request_{kind}"] = float(found.group(1)) if found else 0.0
    return out


async def measure(stack: dict[str, Any], n: int, seconds: float) -> dict[str, Any]:
    """Both paths' latencies and requests/s, and vLLM's connector counters around them."""
    eric, vllm, gateway = stack["eric"], stack["vllm"], stack["gateway"]
    images = Images()
    limits = httpx.Limits(max_connections=2 * CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        model = (await client.get(vllm.url + "/v1/models", headers=vllm.headers)).json()["data"][0]["id"]
        paths = {"direct": Direct(client, eric, vllm), "gateway": ThroughGateway(client, gateway)}
        before = {k: metric(vllm.url, f"vllm:eric_ec_{k}_total") for k in ("loaded_items", "local_encoder_items")}
        sums = gateway_sums(gateway)
        lat = await latencies(paths, model, n, images)
        direct_ms = {k: float(np.mean(v[-n:])) * 1e3 for k, v in paths["direct"].calls_s.items()}
        moved = {k: v - sums.get(k, 0.0) for k, v in gateway_sums(gateway).items()}
        count = moved.pop("epd_request_count")
        per_request = {k: v * 1e3 / count for k, v in moved.items() if v > 0}
        rps = {name: await throughput(path, model, seconds, images) for name, path in paths.items()}
    after = {k: metric(vllm.url, f"vllm:eric_ec_{k}_total") for k in before}
    connector = {k: after[k] - before[k] for k in before}
    return {
        "latency_s": lat,
        "max_rps": rps,
        "connector": connector,
        "gateway_ms_per_request": per_request,
        "direct_calls_ms_per_request": direct_ms,
    }


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Percentiles, overheads (difference of p50s and median of paired differences) and the req/s ratio."""
    lat = raw["latency_s"]
    pct = {name: {q: float(np.percentile(v, q)) * 1e3 for q in (50, 99)} for name, v in lat.items()}
    return {
        **raw,
        "latency_ms": pct,
        "overhead_ms": {f"p{q}": pct["gateway"][q] - pct["direct"][q] for q in (50, 99)},
        "paired_median_overhead_ms": float(np.median(np.subtract(lat["gateway"], lat["direct"]))) * 1e3,
        "rps_ratio": raw["max_rps"]["gateway"] / raw["max_rps"]["direct"],
        "target_p50_overhead_ms": TARGET_P50_MS,
        "images_per_request": IMAGES,
        "side_px": SIDE,
        "concurrency": CONCURRENCY,
        "cores": {"eric": 0, "vllm": 1},
    }


def main() -> None:
    """Start the stack (Eric and the gateway on core 0, vLLM on core 1), measure both paths, write the results."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300, help="requests per path for the latencies")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds of load per path for requests/s")
    ap.add_argument(
        "--gateway-core",
        type=int,
        default=1,
        help="core of the gateway and this client (the direct calls too): vLLM's, idle while Eric encodes, rather "
        "than Eric's, busy while the gateway hands its answer on",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    RESULTS.mkdir(exist_ok=True)
    model = ensure_checkpoint("qwen2_vl", "tiny")
    (RESULTS / "gateway_epd_logs").mkdir(exist_ok=True)
    os.sched_setaffinity(0, {args.gateway_core})
    cores = {"eric_cpus": (0,), "engine_cpus": (1,), "gateway_cpus": (args.gateway_core,)}
    launched = colocated_epd(model, RESULTS / "gateway_epd_logs", **cores)
    with running(*launched.servers):
        raw = asyncio.run(measure(launched.value, args.requests, args.seconds))
    results = summarize(raw)
    results["cores"]["gateway_and_client"] = args.gateway_core
    sent = 2 * IMAGES * (args.requests + 5)  # the latency rounds alone; the load adds more
    if raw["connector"]["local_encoder_items"] != 0 or raw["connector"]["loaded_items"] < sent:
        raise RuntimeError(f"vLLM encoded images itself or loaded fewer than sent: {raw['connector']}")
    (RESULTS / "gateway_epd_overhead.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "gateway_epd_overhead.png", "EPD path", CONCURRENCY)
    pct = results["latency_ms"]
    logger.info(
        "EPD path, %d images per request\n%8s %9s %9s %9s\n%8s %9.2f %9.2f %9.1f\n%8s %9.2f %9.2f %9.1f\n"
        "overhead p50 %.2f ms (target <= %.1f ms), p99 %.2f ms, median of paired differences %.2f ms; "
        "req/s ratio gateway/direct %.2f; connector %s; the gateway's own ms per request %s; direct calls %s",
        IMAGES,
        "",
        "p50 ms",
        "p99 ms",
        "req/s",
        "direct",
        pct["direct"][50],
        pct["direct"][99],
        raw["max_rps"]["direct"],
        "gateway",
        pct["gateway"][50],
        pct["gateway"][99],
        raw["max_rps"]["gateway"],
        results["overhead_ms"]["p50"],
        TARGET_P50_MS,
        results["overhead_ms"]["p99"],
        results["paired_median_overhead_ms"],
        results["rps_ratio"],
        raw["connector"],
        {k: round(v, 3) for k, v in raw["gateway_ms_per_request"].items()},
        {k: round(v, 3) for k, v in raw["direct_calls_ms_per_request"].items()},
    )


if __name__ == "__main__":
    main()
