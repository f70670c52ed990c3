"""Eric (TP 1, over HTTP, concurrency 8) against transformers (HF processor + vision tower, one at a time, in-process),
both on the same CPUs (Eric's half of the host, one torch thread per CPU).

Same checkpoint (the offline *small* Qwen2-VL, or `--family qwen3_vl` / `qwen3_5`), same dtype, same run; float32
and bfloat16; three workloads.
Also measures this CPU's matmul FLOP/s and the ceiling of the tower's own GEMMs alone (same shapes, dtype and
CPUs as Eric's worker), and reports the fraction of each that Eric reaches end to end.
Writes benchmarks/results/encoder_throughput.{json,png}.  Usage: python benchmarks/encoder_throughput.py [--quick]
`--family gemma3` / `internvl`: that family's three encoders in process instead (Eric's own tower, the generic path's,
transformers' full model; benchmarks/encoder_throughput_towers.py with encoder_throughput_<family>.py), writing
encoder_throughput_<family>.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import torch
from eric_repeat import cpu_info

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.servers import EricServer, host_split
from eric_epd.testing.media import image_bytes, random_image

logger = logging.getLogger("encoder_throughput")
RESULTS = Path(__file__).parent / "results"

TOWER_BENCHES = {"gemma3": "encoder_throughput_gemma3", "internvl": "encoder_throughput_internvl"}
"""Families with a tower of Eric's own -> the sibling script benchmarking it against the generic path."""
WORKLOADS = {  # name -> (min side, max side, number of images)
    "small": (112, 224, 64),
    "mixed": (56, 896, 24),
    "large": (448, 896, 12),
}


def make_images(name: str, scale: float, seed: int = 0) -> list[bytes]:
    """Distinct images (Eric dedupes by content, so a repeat would not be encoded again)."""
    lo, hi, n = WORKLOADS[name]
    rng = np.random.default_rng(len(name) + 1000 * seed)
    sizes = rng.integers(lo, hi + 1, size=(max(2, int(n * scale)), 2))
    return [image_bytes(random_image(int(w), int(h), seed=1_000_000 * seed + i)) for i, (w, h) in enumerate(sizes)]


def matmul_flops(dtype: torch.dtype) -> float:
    """Best-of-5 FLOP/s of a 2048^3 matmul on this machine, in nn.Linear's layout (x @ w.T, w stored [out, in]):
    on CPUs without native bfloat16 the row-major a @ b takes a path 30x slower, which is no peak."""
    a, w = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    torch.nn.functional.linear(a, w)
    best = min(_timed(lambda: torch.nn.functional.linear(a, w)) for _ in range(5))
    return 2 * 2048**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _dims(v: dict) -> tuple[int, int, int, int]:
    """(width, MLP width, output width, mergers) of a Qwen2-VL or Qwen3-VL vision config (Qwen3-VL: one merger
    per DeepStack level besides the main one)."""
    if "embed_dim" in v:  # Qwen2-VL / Qwen2.5-VL
        return v["embed_dim"], v.get("intermediate_size") or v["embed_dim"] * v["mlp_ratio"], v["hidden_size"], 1
    levels = len(v.get("deepstack_visual_indexes", []))
    return v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], 1 + levels


def gemm_shapes(cfg: dict, grid: tuple[int, int, int]) -> list[tuple[int, int, int, int]]:
    """(rows, in, out, count) of every linear layer the vision tower runs for one item."""
    v = cfg["vision_config"]
    (d, mlp, out, mergers), depth = _dims(v), v["depth"]
    n = grid[0] * grid[1] * grid[2]
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    merged, merged_in = n // v["spatial_merge_size"] ** 2, d * v["spatial_merge_size"] ** 2
    return [
        (n, patch_in, d, 1),
        (n, d, 3 * d, depth),
        (n, d, d, depth),
        (n, d, mlp, depth),
        (n, mlp, d, depth),
        (merged, merged_in, merged_in, mergers),
        (merged, merged_in, out, mergers),
    ]


def _linear_s(rows: int, k: int, out: int, dtype: torch.dtype) -> float:
    """Best of 2: one F.linear with bias, [rows, k] by [out, k]."""
    x, w, b = torch.randn(rows, k, dtype=dtype), torch.randn(out, k, dtype=dtype), torch.randn(out, dtype=dtype)
    return min(_timed(lambda: torch.nn.functional.linear(x, w, b)) for _ in range(2))


def vision_flops(cfg: dict, grid: tuple[int, int, int]) -> float:
    """Matmul FLOPs of the Qwen2-VL vision tower for one item (linear layers + attention)."""
    v = cfg["vision_config"]
    n, seq = grid[0] * grid[1] * grid[2], grid[1] * grid[2]
    linear = sum(2 * rows * k * out * count for rows, k, out, count in gemm_shapes(cfg, grid))
    return linear + v["depth"] * 4 * n * seq * _dims(v)[0]


@contextlib.contextmanager
def on_cpus(cpus: tuple[int, ...]) -> Iterator[None]:
    """This process on `cpus` with one torch thread per CPU (as Eric's worker there), restored afterwards."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def gemm_ceiling_s(cfg: dict, grids: list[tuple[int, int, int]], dtype: torch.dtype) -> float:
    """Seconds the tower's own linear layers take alone for these items (F.linear with bias, same shapes and
    dtype; called on Eric's CPUs): each distinct shape timed once and counted as often as the tower runs it. The
    tower cannot beat this; attention, norms and the rest come on top."""
    timed: dict[tuple[int, int, int], float] = {}
    total = 0.0
    with torch.inference_mode():
        for grid in grids:
            for rows, k, out, count in gemm_shapes(cfg, grid):
                if (rows, k, out) not in timed:
                    timed[(rows, k, out)] = _linear_s(rows, k, out, dtype)
                total += count * timed[(rows, k, out)]
    return total


def run_transformers(model_dir: Path, dtype: torch.dtype, images: list[bytes]) -> dict:
    """The HF processor and vision tower on one image at a time, in-process: throughput, latencies and grids."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir).image_processor
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    latencies, grids = [], []

    def one(data: bytes) -> None:
        import io

        image = Image.open(io.BytesIO(data)).convert("RGB")
        inputs = processor(images=[image], return_tensors="pt")
        with torch.inference_mode():
            model.model.get_image_features(inputs["pixel_values"].to(dtype), inputs["image_grid_thw"])
        grids.append(tuple(inputs["image_grid_thw"][0].tolist()))

    one(images[0])  # warm-up
    grids.clear()
    start = time.perf_counter()
    for data in images:
        latencies.append(_timed(lambda d=data: one(d)))
    wall = time.perf_counter() - start
    return _summary(latencies, wall, len(images)) | {"grids": grids}


async def _eric_load(eric: EricServer, images: list[bytes], concurrency: int) -> tuple[list[float], float]:
    import base64

    bodies = [
        {"items": [{"modality": "image", "url": "data:image/png;base64," + base64.b64encode(d).decode()}]}
        for d in images
    ]
    latencies: list[float] = []
    queue = list(reversed(bodies))
    async with httpx.AsyncClient(timeout=600, headers=eric.headers) as client:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                t0 = time.perf_counter()
                r = await client.post(eric.url + "/v1/encode", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def run_eric(eric: EricServer, images: list[bytes], concurrency: int, warmup: list[bytes]) -> dict:
    """Eric over HTTP at `concurrency`, after a warm-up: throughput and latencies."""
    asyncio.run(_eric_load(eric, warmup, concurrency))
    latencies, wall = asyncio.run(_eric_load(eric, images, concurrency))
    return _summary(latencies, wall, len(images))


def _summary(latencies: list[float], wall: float, n: int) -> dict:
    return {
        "images_per_s": n / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p99_s": float(np.percentile(latencies, 99)),
        "wall_s": wall,
        "n": n,
    }


def plot(results: dict, path: Path) -> None:
    """Bars of transformers' and Eric's images/s per workload, one panel per dtype, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["runs"]), figsize=(5 * len(results["runs"]), 4), squeeze=False)
    for ax, (dtype, runs) in zip(axes[0], results["runs"].items()):
        names = list(runs)
        x = np.arange(len(names))
        ax.bar(x - 0.2, [runs[n]["transformers"]["images_per_s"] for n in names], 0.4, label="transformers")
        ax.bar(x + 0.2, [runs[n]["eric"]["images_per_s"] for n in names], 0.4, label="Eric (HTTP, c=8)")
        for i, n in enumerate(names):
            ax.text(i + 0.2, runs[n]["eric"]["images_per_s"], f"{runs[n]['ratio']:.2f}x", ha="center", va="bottom")
        ax.set_xticks(x, names)
        ax.set_ylabel("images/s")
        ax.set_title(f"vision encoder throughput, {dtype}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Measure transformers and Eric per dtype and workload, and write the results, plot and table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a quarter of the images (smoke run)")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated dtypes to measure (default float32,bfloat16; float32 for gemma3 and internvl)",
    )
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument(
        "--family",
        default="qwen2_vl",
        choices=("qwen2_vl", "qwen3_vl", "qwen3_5", *TOWER_BENCHES),
        help="which offline small checkpoint (results of other families get their own file); gemma3, "
        "internvl: Eric's own tower against the generic path and transformers, in process",
    )
    ap.add_argument("--rounds", type=int, default=5, help="gemma3, internvl: timed batches of 8 crops per encoder")
    ap.add_argument("--tag", default="", help="suffix of the results' file names (e.g. _amx for a run on another CPU)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.family in TOWER_BENCHES:
        import importlib

        bench = importlib.import_module(TOWER_BENCHES[args.family])  # a sibling script (benchmarks/ is on sys.path)
        bench.main((args.dtypes or "float32").split(","), max(2, args.rounds // 2) if args.quick else args.rounds)
        return
    args.dtypes = args.dtypes or "float32,bfloat16"
    scale = 0.25 if args.quick else 1.0
    model_dir = ensure_checkpoint(args.family, "small")
    out = "encoder_throughput" + ("" if args.family == "qwen2_vl" else f"_{args.family}") + args.tag
    cfg = json.loads((model_dir / "config.json").read_text())
    workloads = {name: make_images(name, scale) for name in WORKLOADS}
    cpus = host_split()[0]
    results: dict = {
        "checkpoint": f"{args.family} small (offline random)",
        "concurrency": args.concurrency,
        "cpus": list(cpus),
        "torch_threads": len(cpus),
        "runs": {},
        "matmul_flops": {},
    }
    RESULTS.mkdir(exist_ok=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        runs: dict = {}
        with on_cpus(cpus):  # the baseline gets exactly Eric's CPUs
            peak = matmul_flops(dtype)
            for name, images in workloads.items():
                logger.info("transformers %s %s (%d images)", dtype_name, name, len(images))
                runs[name] = {"transformers": run_transformers(model_dir, dtype, images)}
            ceilings = {name: gemm_ceiling_s(cfg, runs[name]["transformers"]["grids"], dtype) for name in workloads}
        results["matmul_flops"][dtype_name] = peak
        with EricServer(
            model_dir, extra_args=("--dtype", dtype_name), log_path=RESULTS / "eric_bench.log", cpus=cpus
        ) as eric:
            for name, images in workloads.items():
                logger.info("eric %s %s", dtype_name, name)
                warmup = make_images(name, 0.2, seed=len(results["runs"]) + 1)
                eric_run = run_eric(eric, images, args.concurrency, warmup)
                grids = runs[name]["transformers"].pop("grids")
                flops = sum(vision_flops(cfg, g) for g in grids)
                eric_run["vision_flops_per_s"] = flops / eric_run["wall_s"]
                eric_run["fraction_of_matmul_peak"] = eric_run["vision_flops_per_s"] / peak
                eric_run["gemm_ceiling_s"] = ceilings[name]
                eric_run["fraction_of_gemm_ceiling"] = ceilings[name] / eric_run["wall_s"]
                runs[name]["eric"] = eric_run
                runs[name]["ratio"] = eric_run["images_per_s"] / runs[name]["transformers"]["images_per_s"]
        results["runs"][dtype_name] = runs
    results["cpu"] = cpu_info()
    results["bfloat16_over_float32"] = dtype_ratios(results["runs"])
    (RESULTS / f"{out}.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / f"{out}.png")
    _print_table(results)


def dtype_ratios(runs: dict) -> dict:
    """Per workload, Eric's bfloat16 images/s over its float32 images/s (the CPU encoder's target: >= 3x on a CPU
    with bfloat16 units), when both dtypes ran."""
    if not {"float32", "bfloat16"} <= runs.keys():
        return {}
    return {
        name: runs["bfloat16"][name]["eric"]["images_per_s"] / runs["float32"][name]["eric"]["images_per_s"]
        for name in runs["float32"]
        if name in runs["bfloat16"]
    }


def _print_table(results: dict) -> None:
    lines = [
        f"{'dtype':9} {'workload':8} {'HF img/s':>9} {'Eric img/s':>10} {'ratio':>6} {'HF p50':>7} "
        f"{'Eric p50':>8} {'Eric p99':>8} {'peak frac':>9} {'GEMM ceil':>9}"
    ]
    for dtype, runs in results["runs"].items():
        for name, r in runs.items():
            hf, er = r["transformers"], r["eric"]
            lines.append(
                f"{dtype:9} {name:8} {hf['images_per_s']:9.2f} {er['images_per_s']:10.2f} {r['ratio']:6.2f} "
                f"{hf['p50_s']:7.3f} {er['p50_s']:8.3f} {er['p99_s']:8.3f} "
                f"{er['fraction_of_matmul_peak']:9.2f} {er['fraction_of_gemm_ceiling']:9.2f}"
            )
    for name, ratio in results.get("bfloat16_over_float32", {}).items():
        lines.append(f"Eric bfloat16 / float32 images/s, {name}: {ratio:.2f}x")
    logger.info("results\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
