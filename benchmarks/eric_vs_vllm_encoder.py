"""Eric against vLLM's own multimodal path per core, in one run: `vllm serve --mm-encoder-only` (vLLM's processor and
tower, nothing of the language model; its embeddings go to vLLM's example EC connector) and Eric, eager and
`--compile inductor`, all served on the same single CPU core, same dtype, same images, loaded by the same client.

Each request carries the traffic mix's images (default 4, sides 224 and 448 px, fresh random images per run so no
content or processor cache answers); each run measures every server at concurrency 1 and 8, the servers taking
turns. Reported: images/s per server, medians and min-max over `--runs`, and Eric / vLLM.
Writes benchmarks/results/eric_vs_vllm_encoder<tag>.{json,png}.
Usage: python benchmarks/eric_vs_vllm_encoder.py [--size shaped3b] [--dtype float32] [--runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
from collections.abc import Callable
from itertools import count
from pathlib import Path

import httpx

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus, pin_process
from eric_epd.planning.measure_eric import image_urls, post_all
from eric_epd.planning.profiles import Traffic
from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import EricServer, VllmServe

logger = logging.getLogger("eric_vs_vllm_encoder")
RESULTS = Path(__file__).parent / "results"
CONCURRENCIES = (1, 8)


class Target:
    """One served encoder: how a request of image URLs is posted to it."""

    def __init__(self, name: str, server: ServerProcess, path: str, body: Callable[[list[str]], dict]) -> None:
        self.name, self.server, self.path, self.body = name, server, path, body

    def images_per_s(self, requests: list[list[str]], concurrency: int) -> float:
        """Post every request with `concurrency` clients; images encoded per wall second."""
        bodies = [self.body(urls) for urls in requests]
        _, wall = asyncio.run(post_all(self.server.url + self.path, self.server.headers, bodies, concurrency))
        return sum(map(len, requests)) / wall


def vllm_encoder_only(model: Path, dtype: str, core: int, store: Path, log: Path) -> VllmServe:
    """vLLM as an encoder instance: processor and tower only, its outputs saved by vLLM's example EC producer."""
    ec = {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": str(store)},
    }
    return VllmServe(
        model, log, extra=("--mm-encoder-only", "--ec-transfer-config", json.dumps(ec)), dtype=dtype, cpus=(core,)
    )


def chat_body(name: str) -> Callable[[list[str]], dict]:
    """An OpenAI chat request with the images and one output token (an encoder-only instance stops at the prompt)."""

    def body(urls: list[str]) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        return {
            "model": name,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}],
        }

    return body


def encode_body(urls: list[str]) -> dict:
    """Eric's encode request for the images."""
    return {"items": [{"modality": "image", "url": u} for u in urls]}


def run(args: argparse.Namespace, logs: Path) -> dict:
    """Start the three servers on one core (the client on another), then the runs; the per-run images/s."""
    cpus = available_cpus()
    core, client = cpus[-1], cpus[0]
    pin_process((client,))
    model = ensure_checkpoint(args.family, args.size)
    traffic = Traffic(images_per_request=args.images, sides=tuple(args.sides), prompt_tokens=64, output_tokens=1)
    seeds = count(7)
    rates: dict[str, dict[int, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        vllm = stack.enter_context(vllm_encoder_only(model, args.dtype, core, store, logs / "vllm.log"))
        name = httpx.get(vllm.url + "/v1/models", headers=vllm.headers, timeout=30).json()["data"][0]["id"]
        targets = [Target("vllm", vllm, "/v1/chat/completions", chat_body(name))]
        for mode in ("none", "inductor"):
            eric = stack.enter_context(
                EricServer(
                    model,
                    extra_args=("--dtype", args.dtype, "--compile", mode),
                    cpus=(core,),
                    log_path=logs / f"eric-{mode}.log",
                )
            )
            targets.append(Target(f"eric_{'eager' if mode == 'none' else 'compiled'}", eric, "/v1/encode", encode_body))
        for target in targets:  # warm-up: every side once
            target.images_per_s([image_urls(traffic, seeds) for _ in range(2)], 1)
        for r in range(args.runs):
            for c in CONCURRENCIES:
                requests = [image_urls(traffic, seeds) for _ in range(args.requests)]
                for target in targets:
                    ips = target.images_per_s(requests, c)
                    rates.setdefault(target.name, {}).setdefault(c, []).append(ips)
                    logger.info("run %d, concurrency %d, %s: %.2f images/s", r, c, target.name, ips)
    return rates


def summarize(rates: dict[str, dict[int, list[float]]]) -> dict:
    """Medians and spread per server and concurrency, and each Eric's median over vLLM's."""
    out = {}
    for name, by_c in rates.items():
        out[name] = {
            str(c): {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for c, v in by_c.items()
        }
    for name in out:
        if name != "vllm":
            for c, cell in out[name].items():
                cell["vs_vllm"] = cell["median"] / out["vllm"][c]["median"]
    return out


def plot(summary: dict, path: Path, title: str, unit: str = "images") -> None:
    """Items/s per server at each concurrency (median bars, min-max whiskers), Eric's ratio over vLLM on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(summary)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        cells = [summary[name][str(c)] for c in CONCURRENCIES]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(CONCURRENCIES))]
        meds = [cell["median"] for cell in cells]
        errs = [[m - cell["min"] for m, cell in zip(meds, cells)], [cell["max"] - m for m, cell in zip(meds, cells)]]
        ax.bar(xs, meds, width, yerr=errs, label=name, capsize=3)
        for x, cell in zip(xs, cells):
            if "vs_vllm" in cell:
                ax.text(x, cell["max"], f"{cell['vs_vllm']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(CONCURRENCIES)), [f"concurrency {c}" for c in CONCURRENCIES])
    ax.set_ylabel(f"{unit}/s on one core")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Parse the flags, measure, write the JSON and the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2_5_vl", help="the offline checkpoint's family")
    parser.add_argument("--size", default="shaped3b", help="the offline checkpoint's size (shaped3b, small, ...)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides' dtype")
    parser.add_argument("--images", type=int, default=4, help="images per request")
    parser.add_argument("--sides", type=int, nargs="+", default=[224, 448], help="image sides, in turn (px)")
    parser.add_argument("--requests", type=int, default=16, help="requests per point")
    parser.add_argument("--runs", type=int, default=3, help="runs (each measures every server at each concurrency)")
    parser.add_argument("--quick", action="store_true", help="one run of 4 requests per point")
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.requests = 1, 4
    logs = RESULTS / f"eric_vs_vllm_encoder{args.tag}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    summary = summarize(run(args, logs))
    title = (
        f"{args.family} {args.size}, {args.dtype}, {args.images} images of {args.sides} px a request, "
        f"one core each, {args.runs} runs"
    )
    result = {
        "what": title,
        "concurrencies": list(CONCURRENCIES),
        "servers": summary,
        "vllm": "vllm serve --mm-encoder-only (processor + tower; ECExampleConnector producer)",
        "eric": "eric-epd serve, --compile none and inductor (router, engine, worker on the same core)",
    }
    (RESULTS / f"eric_vs_vllm_encoder{args.tag}.json").write_text(json.dumps(result, indent=2))
    plot(summary, RESULTS / f"eric_vs_vllm_encoder{args.tag}.png", title)
    for name, cells in summary.items():
        logger.info(
            "%s: %s", name, {c: (round(v["median"], 2), round(v.get("vs_vllm", 1), 2)) for c, v in cells.items()}
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    main()
