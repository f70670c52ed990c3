"""GB/s of each transfer backend (shm, NIXL, Mooncake, HTTP) pulling 1-256 MiB from a producer process,
with memcpy measured in the same run as the physical limit.

Writes benchmarks/results/transfer.{json,png}.  Usage: python benchmarks/transfer.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import httpx
import numpy as np

from eric_epd.testing.pool_server import seeded_bytes
from eric_epd.testing.server import PoolServer
from eric_epd.transfer.client import EmbeddingFetcher, as_handle

logger = logging.getLogger("transfer_bench")
RESULTS = Path(__file__).parent / "results"
BACKENDS = ["shm", "nixl", "mooncake", "http"]


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, after one warm-up call."""
    fn()  # warm-up (connections, registrations, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """GB/s of a plain numpy copy of `nbytes` (the ceiling every backend is compared to)."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return nbytes / best_time(lambda: np.copyto(dst, src), repeats) / 1e9


def plot(results: dict, path: Path) -> None:
    """GB/s against transfer size, one line per backend and memcpy, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = results["sizes_mib"]
    for name in ["memcpy", *BACKENDS]:
        ys = [results["gbps"][name].get(str(s)) for s in sizes]
        ax.plot(sizes, ys, marker="o", label=name, linestyle="--" if name == "memcpy" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("embedding fetch from Eric's pool, one host")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Measure each backend pulling entries of each size from a pool server, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 MiB, fewer repeats")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sizes = [1, 16, 64] if args.quick else [1, 16, 64, 256]
    repeats = 3 if args.quick else 5
    RESULTS.mkdir(exist_ok=True)
    results: dict = {"sizes_mib": sizes, "gbps": {name: {} for name in ["memcpy", *BACKENDS]}}
    with PoolServer(pool_bytes=(sum(sizes) + 8) << 20, log_path=RESULTS / "pool_server.log") as producer:
        for mib in sizes:
            nbytes = mib << 20
            results["gbps"]["memcpy"][str(mib)] = memcpy_gbps(nbytes, repeats)
            resp = httpx.post(
                producer.url + "/v1/testing/entries",
                json={"hash": f"bench-{mib}", "nbytes": nbytes, "seed": mib},
                timeout=120,
            )
            resp.raise_for_status()
            handle = as_handle(resp.json())
            expected = seeded_bytes(nbytes, mib)
            for name in BACKENDS:
                fetcher = EmbeddingFetcher([name], http_timeout_s=120, api_key=producer.api_key)  # None: no key
                dst = np.empty(nbytes, np.uint8)
                seconds = best_time(lambda f=fetcher, d=dst, h=handle: f.read_into(h, d), repeats)
                assert np.array_equal(dst, expected), f"{name} delivered wrong bytes at {mib} MiB"
                results["gbps"][name][str(mib)] = nbytes / seconds / 1e9
                fetcher.close()
    half = results["gbps"]["shm"]["64"] / results["gbps"]["memcpy"]["64"]
    results["shm_fraction_of_memcpy_at_64MiB"] = half
    (RESULTS / "transfer.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "transfer.png")
    lines = [f"{'MiB':>5} " + " ".join(f"{n:>9}" for n in ["memcpy", *BACKENDS]) + "   (GB/s; ratio to memcpy)"]
    for mib in sizes:
        mc = results["gbps"]["memcpy"][str(mib)]
        cells = [f"{mc:9.2f}"] + [
            f"{results['gbps'][n][str(mib)]:5.2f}/{results['gbps'][n][str(mib)] / mc:.2f}" for n in BACKENDS
        ]
        lines.append(f"{mib:5d} " + " ".join(f"{c:>9}" for c in cells))
    lines.append(f"shm at 64 MiB reaches {half:.2f} of memcpy (target >= 0.5)")
    logger.info("results\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
