"""Latency the gateway adds (p50/p99) and the most requests/s through it, against calling the same vLLM directly.

Same run, same upstream (vLLM on the tiny checkpoint, text-only, 1 output token), requests interleaved so drift hits
both equally. Writes benchmarks/results/gateway_overhead.{json,png}.  Usage: python benchmarks/gateway_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import numpy as np

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.servers import GatewayServer, VllmServe

logger = logging.getLogger("gateway_overhead")
RESULTS = Path(__file__).parent / "results"
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0.0}


async def latencies(urls: dict[str, tuple[str, dict[str, str]]], n: int) -> dict[str, list[float]]:
    """name -> (url, headers): vLLM directly needs its key, the gateway sends it upstream itself."""
    out: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=60) as client:
        direct, direct_headers = urls["direct"]
        model = (await client.get(direct + "/v1/models", headers=direct_headers)).json()["data"][0]["id"]
        body = {**BODY, "model": model}
        for _ in range(5):  # warm-up
            for url, headers in urls.values():
                (await client.post(url + "/v1/chat/completions", json=body, headers=headers)).raise_for_status()
        for _ in range(n):
            for name, (url, headers) in urls.items():
                start = time.perf_counter()
                (await client.post(url + "/v1/chat/completions", json=body, headers=headers)).raise_for_status()
                out[name].append(time.perf_counter() - start)
    return out


async def throughput(url: str, headers: dict[str, str], seconds: float, concurrency: int) -> float:
    """Requests/s of chat completions to `url` at `concurrency`, over `seconds`."""
    async with httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=concurrency), headers=headers
    ) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        body = {**BODY, "model": model}
        done = 0
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                (await client.post(url + "/v1/chat/completions", json=body)).raise_for_status()
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def plot(results: dict, path: Path, path_name: str = "", concurrency: int = 16) -> None:
    """The latency histograms of both targets and their most requests/s (at `concurrency`), saved to `path`;
    `path_name` names the gateway's path in the title (gateway_epd_overhead.py: "EPD path")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("direct", "gateway"):
        a.hist(np.array(results["latency_s"][name]) * 1e3, bins=50, alpha=0.6, label=name)
    a.set_xlabel("latency (ms)")
    a.set_title(f"{path_name + ': ' if path_name else ''}p50 overhead {results['overhead_ms']['p50']:.2f} ms")
    a.legend()
    b.bar(["direct", "gateway"], [results["max_rps"]["direct"], results["max_rps"]["gateway"]])
    b.set_ylabel("requests/s")
    b.set_title(f"most requests/s (concurrency {concurrency})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Measure vLLM directly and through the gateway, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300, help="requests per configuration")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds of load per configuration")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    RESULTS.mkdir(exist_ok=True)
    model = ensure_checkpoint("qwen2_vl", "tiny")
    with (
        VllmServe(model, RESULTS / "gateway_vllm.log") as vllm,
        GatewayServer(RESULTS / "gateway.log", "--colocated-urls", vllm.url, upstream_api_key=vllm.api_key) as gateway,
    ):
        targets = {"direct": (vllm.url, vllm.headers), "gateway": (gateway.url, gateway.headers)}
        lat = asyncio.run(latencies(targets, args.requests))
        rps = {
            name: asyncio.run(throughput(url, headers, args.seconds, 16)) for name, (url, headers) in targets.items()
        }
    pct = {name: {q: float(np.percentile(v, q)) * 1e3 for q in (50, 99)} for name, v in lat.items()}
    results = {
        "latency_s": lat,
        "latency_ms": pct,
        "max_rps": rps,
        "overhead_ms": {f"p{q}": pct["gateway"][q] - pct["direct"][q] for q in (50, 99)},
        "paired_median_overhead_ms": float(np.median(np.subtract(lat["gateway"], lat["direct"]))) * 1e3,
        "rps_ratio": rps["gateway"] / rps["direct"],
        "target_p50_overhead_ms": 2.0,
    }
    (RESULTS / "gateway_overhead.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "gateway_overhead.png")
    logger.info(
        "results\n%8s %9s %9s %9s\n%8s %9.2f %9.2f %9.1f\n%8s %9.2f %9.2f %9.1f\n"
        "overhead p50 %.2f ms (target <= 2 ms), p99 %.2f ms, median of paired differences %.2f ms; "
        "req/s ratio gateway/direct %.2f",
        "",
        "p50 ms",
        "p99 ms",
        "req/s",
        "direct",
        pct["direct"][50],
        pct["direct"][99],
        rps["direct"],
        "gateway",
        pct["gateway"][50],
        pct["gateway"][99],
        rps["gateway"],
        results["overhead_ms"]["p50"],
        results["overhead_ms"]["p99"],
        results["paired_median_overhead_ms"],
        results["rps_ratio"],
    )


if __name__ == "__main__":
    main()
