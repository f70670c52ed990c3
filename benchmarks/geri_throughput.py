"""Geri's throughput and latency against diffusers' QwenImagePipeline called directly, same run, same core.

The small offline Qwen-Image checkpoint (4 layers of width 512), 64x64 images, 4 steps, prompts of 12-40 tokens.
Baseline: the pipeline in this process on Geri's core (one torch thread), one image at a time (it has no server, so
under concurrency it serves one request after another). Ours: `eric-epd geri` on that core over HTTP (httpx), at
concurrency 1 (latency) and 8 (images/s; same-size requests batch in Geri's engine). The load generator runs on the
other core. Writes benchmarks/results/geri_throughput.{json,png}.
Usage: python benchmarks/geri_throughput.py [--requests 48] [--size small] [--side 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from eric_epd.checkpoints.qwen_image import SIZES, ensure_qwen_image_checkpoint
from eric_epd.stack.servers import GeriServer, host_split
from eric_epd.wire.geri import generate_body

logger = logging.getLogger("geri_throughput")
RESULTS = Path(__file__).parent / "results"


def prompts(n: int, hidden: int) -> list[np.ndarray]:
    """`n` random float32 prompt embeddings of 12 to 40 tokens, `hidden` wide, seeded."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal((int(rng.integers(12, 41)), hidden)).astype(np.float32) for _ in range(n)]


def pipeline_alone(model: Path, embeds: list[np.ndarray], side: int, steps: int, core: int) -> list[float]:
    """Seconds per image of QwenImagePipeline in this process on `core` (one torch thread)."""
    from diffusers import QwenImagePipeline

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    pipe = QwenImagePipeline.from_pretrained(model, torch_dtype=torch.float32, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for i, e in enumerate(embeds):
        start = time.perf_counter()
        pipe(
            prompt_embeds=torch.from_numpy(e)[None],
            prompt_embeds_mask=torch.ones(1, e.shape[0], dtype=torch.long),
            height=side,
            width=side,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(i),
            output_type="np",
        )
        out.append(time.perf_counter() - start)
    return out


async def geri_load(
    geri: GeriServer, embeds: list[np.ndarray], side: int, steps: int, concurrency: int
) -> tuple[list[float], float]:
    """(latency per request, wall seconds) of all requests at `concurrency`."""
    bodies = [generate_body(e, height=side, width=side, steps=steps, seed=i) for i, e in enumerate(embeds)]
    queue = list(enumerate(bodies))
    latencies: list[float] = [0.0] * len(bodies)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, body = queue.pop(0)
            start = time.perf_counter()
            r = await client.post(geri.url + "/v1/generate", json=body, headers=geri.headers)
            r.raise_for_status()
            latencies[i] = time.perf_counter() - start

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    """Images per second, and the latency p50 and p99."""
    return {
        "images_per_s": len(latencies) / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p99_s": float(np.percentile(latencies, 99)),
    }


def plot(result: dict, path: Path) -> None:
    """Bars of images/s and latency p50 per row, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(rows)
    a.bar(names, [rows[n]["images_per_s"] for n in names], color=["gray", "tab:blue", "tab:green"])
    a.set_ylabel("images/s")
    b.bar(names, [rows[n]["p50_s"] for n in names], color=["gray", "tab:blue", "tab:green"])
    b.set_ylabel("latency p50 (s)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"Geri vs QwenImagePipeline ({result['size']}, {result['side']}px, {result['steps']} steps)")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    """Measure the pipeline alone, then Geri at concurrency 1 and 8, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48, help="image requests per run")
    ap.add_argument("--size", choices=tuple(SIZES), default="small", help="checkpoint size")
    ap.add_argument("--side", type=int, default=64, help="image width and height in pixels")
    ap.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    ap.add_argument(
        "--out", type=Path, default=RESULTS / "geri_throughput", help="output path stem (.json and .png written)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = ensure_qwen_image_checkpoint(args.size)
    hidden = SIZES[args.size]["joint_attention_dim"]
    embeds = prompts(args.requests, hidden)
    geri_core, load_core = host_split()[0][0], host_split()[1][0]
    rows: dict[str, dict[str, float]] = {}
    base = pipeline_alone(model, embeds, args.side, args.steps, geri_core)
    rows["pipeline, one at a time"] = summary(base, sum(base))
    os.sched_setaffinity(0, {load_core})
    with GeriServer(model, cpus=(geri_core,), log_path=args.out.with_suffix(".log")) as geri:
        asyncio.run(geri_load(geri, embeds[:4], args.side, args.steps, 1))  # warm the server up
        for concurrency in (1, 8):
            rows[f"Geri, concurrency {concurrency}"] = summary(
                *asyncio.run(geri_load(geri, embeds, args.side, args.steps, concurrency))
            )
    baseline = rows["pipeline, one at a time"]
    print(f"{'':28} {'images/s':>9} {'ratio':>6} {'p50 s':>7} {'p99 s':>7}")
    for name, row in rows.items():
        print(
            f"{name:28} {row['images_per_s']:9.2f} {row['images_per_s'] / baseline['images_per_s']:6.2f}x "
            f"{row['p50_s']:7.3f} {row['p99_s']:7.3f}"
        )
    result = {"size": args.size, "side": args.side, "steps": args.steps, "requests": args.requests, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
