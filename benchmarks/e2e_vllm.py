"""End-to-end TTFT p50/p99 and requests/s, 4-image chat requests, monolithic `vllm serve` against vLLM + Eric (EPD).

Writes benchmarks/results/e2e_vllm.{json,png}.  Usage: python benchmarks/e2e_vllm.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus
from eric_epd.stack.servers import EricServer, VllmServe, host_split
from eric_epd.testing.media import data_url, image_bytes, random_image
from eric_epd.wire.handoff import handles_xargs

logger = logging.getLogger("e2e_vllm")
RESULTS = Path(__file__).parent / "results"

IMAGES_PER_REQUEST = 4
SIDES = (224, 448)  # image width and height, drawn uniformly: 64..256 LLM tokens per image
MAX_TOKENS = 8
DTYPE = "float32"
SERIES = ("distinct", "repeat")  # repeat: 2 of the 4 images of every request were sent by an earlier request
TEXT = "Describe what you see."


# both systems: the same vLLM flags. Monolithic vLLM has every core; with EPD, Eric and vLLM get disjoint halves
# (as `eric-epd up` places them). Sharing cores starves Eric: vLLM's workers busy-poll for a second after every
# step, and while requests wait for their embeddings the engine steps every few milliseconds (measured here: with
# vLLM's OpenMP threads bound to Eric's core too, encodes took 35 s and fetches timed out).
VLLM_EXTRA = ("--max-num-seqs", "8", "--seed", "0")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2"}


# ---- workload -------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The requests of one (series, concurrency) run: each a list of IMAGES_PER_REQUEST data URLs."""

    name: str
    concurrency: int
    requests: list[list[str]]
    num_repeats: int = 0


def _fresh(rng: np.random.Generator, seed: int) -> str:
    w, h = rng.integers(SIDES[0], SIDES[1] + 1, size=2)
    return data_url(image_bytes(random_image(int(w), int(h), seed=seed)))


def make_workload(series: str, concurrency: int, num_requests: int, earlier: list[str]) -> Workload:
    """Fresh images never sent before (seeds unique per run); in the repeat series 2 of the 4 slots (random ones)
    reuse an image of an earlier request of the run (of the warm-up, `earlier`, for the first request)."""
    base = 1_000_000 * (1 + SERIES.index(series)) + 10_000 * concurrency
    rng = np.random.default_rng(base)
    seen = list(earlier)
    requests, repeats = [], 0
    for i in range(num_requests):
        urls = [_fresh(rng, base + IMAGES_PER_REQUEST * i + j) for j in range(IMAGES_PER_REQUEST)]
        if series == "repeat":
            slots = rng.choice(IMAGES_PER_REQUEST, IMAGES_PER_REQUEST // 2, replace=False)
            for slot, old in zip(slots, rng.choice(len(seen), len(slots), replace=False)):
                urls[slot] = seen[old]
                repeats += 1
        seen += [u for u in urls if u not in seen]
        requests.append(urls)
    return Workload(f"{series}_c{concurrency}", concurrency, requests, repeats)


def warmup_workload(num_requests: int) -> Workload:
    """Distinct images of their own, sent once to each system before its runs."""
    rng = np.random.default_rng(7)
    return Workload(
        "warmup",
        4,
        [
            [_fresh(rng, 7_000_000 + IMAGES_PER_REQUEST * i + j) for j in range(IMAGES_PER_REQUEST)]
            for i in range(num_requests)
        ],
    )


# ---- one request, one run -------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One request's timings: TTFT, whole latency, Eric's encode call (EPD) and the prompt's token count."""

    ttft_s: float
    latency_s: float
    encode_s: float = 0.0  # EPD: the Eric /v1/encode call, part of ttft_s
    prompt_tokens: int = 0


@dataclass
class Client:
    """Sends one chat request with 4 images, streaming, and times it from before any work to the first chunk
    (vLLM sends its first chunk with the first generated token). EPD: Eric's handles (with their lease tokens) go to
    vLLM beside the metadata-only parts, in vllm_xargs, as the gateway sends them."""

    vllm_url: str
    vllm_api_key: str | None
    eric_url: str | None
    eric_headers: dict[str, str] = field(default_factory=dict)
    model: str = ""
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=600))

    def __post_init__(self) -> None:
        import openai

        self.openai = openai.AsyncOpenAI(
            base_url=self.vllm_url + "/v1", api_key=self.vllm_api_key or "unused", max_retries=0, timeout=600
        )

    async def request(self, urls: list[str]) -> Sample:
        """Send one streamed chat of these images (EPD: encoded by Eric first) and time it."""
        t0 = time.perf_counter()
        encode_s = 0.0
        extra: dict = {"ignore_eos": True}
        if self.eric_url is None:
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        else:
            resp = await self.http.post(
                self.eric_url + "/v1/encode",
                headers=self.eric_headers,
                json={"items": [{"modality": "image", "url": u} for u in urls]},
            )
            resp.raise_for_status()
            encode_s = time.perf_counter() - t0
            items = resp.json()["items"]
            parts = [
                {"type": "image_embeds", "image_embeds": {"image_grid_thw": item["grid_thw"]}, "uuid": item["hash"]}
                for item in items
            ]
            extra["vllm_xargs"] = handles_xargs({item["hash"]: item["handle"] for item in items}.values())
        stream = await self.openai.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        ttft, finish, usage = None, None, None
        async for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        if ttft is None or finish != "length":
            raise RuntimeError(f"request ended with finish_reason {finish!r} (ttft {ttft})")
        return Sample(ttft, time.perf_counter() - t0, encode_s, usage.prompt_tokens if usage else 0)

    async def run(self, workload: Workload) -> tuple[list[Sample], float]:
        """Run the workload's requests at its concurrency; the samples and the wall time."""
        if not self.model:
            self.model = (await self.openai.models.list()).data[0].id
        queue = list(reversed(workload.requests))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await self.request(queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        return samples, time.perf_counter() - start

    async def close(self) -> None:
        """Close the HTTP and openai clients."""
        await self.http.aclose()
        await self.openai.close()


def summary(samples: list[Sample], wall: float) -> dict:
    """A run's request rate and its TTFT, latency, encode and prompt-size statistics."""
    ttft = [s.ttft_s for s in samples]
    return {
        "n": len(samples),
        "wall_s": wall,
        "requests_per_s": len(samples) / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(np.mean(ttft)),
        "latency_p50_s": float(np.percentile([s.latency_s for s in samples], 50)),
        "encode_p50_s": float(np.percentile([s.encode_s for s in samples], 50)),
        "prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in samples])),
    }


def eric_counters(vllm_url: str) -> dict[str, float]:
    """vLLM's EricECConnector counters (items from Eric, loaded, encoded locally) from its /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(vllm_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:eric_ec_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0].removeprefix("vllm:eric_ec_")
            if key.endswith("_total"):
                out[key.removesuffix("_total")] = out.get(key.removesuffix("_total"), 0.0) + float(value)
    return out


def eric_stats(eric: EricServer) -> dict:
    """Eric's view: items encoded or served from its pool, and pool entries still leased (a repeat that vLLM
    found in its own encoder cache is encoded or leased at Eric but never fetched, so never acknowledged)."""
    items: dict[str, float] = {}
    for line in httpx.get(eric.url + "/metrics", timeout=30).text.splitlines():  # /metrics needs no key
        if line.startswith("eric_items_total{"):
            source = line.split('source="')[1].split('"')[0]
            items[source] = items.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"items": items, "pool": httpx.get(eric.url + "/v1/transfer", headers=eric.headers, timeout=30).json()}


def run_system(
    system: str, model_dir: Path, eric: EricServer | None, workloads: list[Workload], warmup: Workload
) -> dict:
    """Start vLLM for one system, warm it up, run every workload one after the other, stop it."""
    eric_url = eric.url if eric is not None else None
    runs: dict = {}
    cpus = host_split()[1] if eric is not None else available_cpus()
    with VllmServe(
        model_dir,
        RESULTS / f"e2e_vllm_{system}.log",
        [eric_url] if eric_url else None,
        VLLM_EXTRA,
        VLLM_ENV,
        DTYPE,
        eric_api_key=eric.api_key if eric is not None else None,
        cpus=cpus,
    ) as server:
        client = Client(server.url, server.api_key, eric_url, eric.headers if eric is not None else {})

        async def all_runs() -> None:
            await client.run(warmup)
            for workload in workloads:
                logger.info("%s %s (%d requests)", system, workload.name, len(workload.requests))
                samples, wall = await client.run(workload)
                runs[workload.name] = summary(samples, wall) | {"loadavg_1m": os.getloadavg()[0]}
                logger.info(
                    "%s %s: %s", system, workload.name, {k: round(v, 3) for k, v in runs[workload.name].items()}
                )
            await client.close()

        before = eric_counters(server.url) if eric is not None else {}
        asyncio.run(all_runs())
        if eric is not None:
            after = eric_counters(server.url)
            runs["eric_ec_counters"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            runs["eric"] = eric_stats(eric)
    return runs


# ---- report ---------------------------------------------------------------------------------------------------


def ratios(results: dict) -> dict:
    """EPD over monolithic, per run: TTFT p50 and p99, and requests/s."""
    out = {}
    for name in results["repeats_per_run"]:
        mono, epd = results["runs"]["monolithic"][name], results["runs"]["epd"][name]
        out[name] = {
            "ttft_p50": epd["ttft_p50_s"] / mono["ttft_p50_s"],
            "ttft_p99": epd["ttft_p99_s"] / mono["ttft_p99_s"],
            "requests_per_s": epd["requests_per_s"] / mono["requests_per_s"],
        }
    return out


def plot(results: dict, path: Path) -> None:
    """Bars of both systems' TTFT p50, p99 and requests/s per run, with their ratios, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["ratios"])
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"), ("requests_per_s", "requests/s")]
    for ax, (key, label) in zip(axes, panels):
        for dx, system, title in ((-0.2, "monolithic", "vLLM"), (0.2, "epd", "vLLM + Eric")):
            ax.bar(x + dx, [results["runs"][system][n][key] for n in names], 0.4, label=title)
        ratio_key = key if key == "requests_per_s" else key.removesuffix("_s")
        for i, n in enumerate(names):
            top = max(results["runs"][s][n][key] for s in ("monolithic", "epd"))
            ax.text(i, top, f"{results['ratios'][n][ratio_key]:.2f}x", ha="center", va="bottom")
        ax.set_xticks(x, names)
        ax.set_ylabel(label)
        ax.set_title(f"{label}, EPD/monolithic above")
        ax.legend()
    fig.suptitle(
        f"{IMAGES_PER_REQUEST} images/request ({SIDES[0]}-{SIDES[1]} px), qwen2_vl small, {DTYPE}, "
        f"{os.cpu_count()} CPU cores shared"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _print_table(results: dict) -> None:
    lines = [
        f"{'run':12} {'mono p50':>8} {'EPD p50':>8} {'mono p99':>8} {'EPD p99':>8} {'mono r/s':>8} "
        f"{'EPD r/s':>8} | {'p50 x':>6} {'p99 x':>6} {'r/s x':>6}"
    ]
    for name, r in results["ratios"].items():
        mono, epd = results["runs"]["monolithic"][name], results["runs"]["epd"][name]
        lines.append(
            f"{name:12} {mono['ttft_p50_s']:8.3f} {epd['ttft_p50_s']:8.3f} {mono['ttft_p99_s']:8.3f} "
            f"{epd['ttft_p99_s']:8.3f} {mono['requests_per_s']:8.3f} {epd['requests_per_s']:8.3f} | "
            f"{r['ttft_p50']:6.2f} {r['ttft_p99']:6.2f} {r['requests_per_s']:6.2f}"
        )
    lines.append("ratios are EPD/monolithic: TTFT below 1 and requests/s above 1 favour EPD")
    logger.info("results\n%s", "\n".join(lines))


def main() -> None:
    """Run every workload on monolithic vLLM, then on vLLM + Eric, and write the results, plot and table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer requests (smoke run: ~2 minutes of requests plus two vLLM start-ups)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run at concurrency 1 (twice as many at concurrency 4; default 6, --quick 2)",
    )
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory of any registered family (default: the offline small Qwen2-VL)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("httpx", "httpx2"):  # openai uses httpx2
        logging.getLogger(name).setLevel(logging.WARNING)
    n1 = args.requests or (2 if args.quick else 6)
    start = time.perf_counter()
    model_dir = args.model or ensure_checkpoint("qwen2_vl", "small")
    warmup = warmup_workload(4 if not args.quick else 2)
    earlier = [u for r in warmup.requests for u in r]
    workloads = [make_workload(s, c, n1 if c == 1 else 2 * n1, earlier) for s in SERIES for c in (1, 4)]
    RESULTS.mkdir(exist_ok=True)
    results: dict = {
        "checkpoint": str(args.model) if args.model else "qwen2_vl small (offline random)",
        "dtype": DTYPE,
        "images_per_request": IMAGES_PER_REQUEST,
        "image_sides_px": SIDES,
        "max_tokens": MAX_TOKENS,
        "cpu_cores": os.cpu_count(),
        "vllm_env": VLLM_ENV,
        "repeats_per_run": {w.name: w.num_repeats for w in workloads},
        "ttft": "from before the request (EPD: before Eric's /v1/encode) to vLLM's first streamed chunk",
        "layout": "one system at a time; monolithic vLLM on every core; EPD: Eric (TP 1) on the first "
        "half of the cores, vLLM on the other half",
        "runs": {},
    }
    results["runs"]["monolithic"] = run_system("monolithic", model_dir, None, workloads, warmup)
    # keep acknowledged embeddings as a content cache so repeated images are not encoded again
    eric_args = ("--dtype", DTYPE, "--keep-acked-bytes", str(256 << 20))
    with EricServer(model_dir, extra_args=eric_args, log_path=RESULTS / "e2e_vllm_eric.log") as eric:
        results["runs"]["epd"] = run_system("epd", model_dir, eric, workloads, warmup)
    results["ratios"] = ratios(results)
    results["runtime_s"] = time.perf_counter() - start
    (RESULTS / "e2e_vllm.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "e2e_vllm.png")
    _print_table(results)
    logger.info("total %.0f s", results["runtime_s"])


if __name__ == "__main__":
    main()
