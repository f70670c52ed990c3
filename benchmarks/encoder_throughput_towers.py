"""The harness of the towers-of-Eric's-own benchmarks (encoder_throughput_gemma3.py, encoder_throughput_internvl.py):
one family's vision encoders on batches of 8 crops (concurrency 8): Eric's own tower (behind the generic runner's
interface), the generic path's encoder (models/hf HFVisionEncoder: transformers' classes, vision only) and
transformers' full model's get_image_features; in process, same dtype, same CPUs and threads.

Pixels are random crops in [-1, 1] (what the processor's normalisation gives); processing, HTTP and transfer are left
out (they are the same on both of Eric's paths; benchmarks/eric_overhead.py measures them). Each round runs one batch
of each implementation in turn (so drift hits all three alike); images/s is 8 / the median batch time. Also: the
floor of the tower's own GEMMs and attention alone (same shapes), and a one-batch torch.profiler table of each
encoder. Writes benchmarks/results/encoder_throughput_<family>.{json,png}.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from encoder_throughput import RESULTS, matmul_flops, on_cpus  # a sibling script (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import cache_root, ensure_built
from eric_epd.stack.servers import host_split

logger = logging.getLogger("encoder_throughput")

BATCH = 8
"""Crops per forward: concurrency 8 of one-crop images, as Eric's scheduler joins them."""


@dataclass(frozen=True)
class TowerBench:
    """One family's benchmark: its scaled checkpoint and the shapes of its tower's GEMMs and attention."""

    family: str
    """The model_type (facts.GENERIC_TOWERS names its tower); also the results' file suffix."""
    title: str
    checkpoint: str
    """The cache directory name of its random checkpoint (bump its version when `build` changes)."""
    scale: str
    """How the real tower was scaled down, for the results."""
    build: Callable[[Path], None]
    image_size: int
    tokens: int
    """Rows per crop."""
    floor: Callable[[torch.dtype], float]
    """dtype -> seconds the tower's own GEMMs and attention take alone for one batch (floor_linear_s and
    floor_attention_s on its shapes): no implementation can beat it; norms, activations and copies add on."""


def _best(fn: Callable[[], object]) -> float:
    """Best of 2 timed calls."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def floor_linear_s(rows: int, k: int, out: int, dtype: torch.dtype) -> float:
    """Seconds of one F.linear with bias of these shapes (best of 2)."""
    x, w, b = torch.randn(rows, k, dtype=dtype), torch.randn(out, k, dtype=dtype), torch.randn(out, dtype=dtype)
    with torch.inference_mode():
        return _best(lambda: F.linear(x, w, b))


def floor_attention_s(heads: int, length: int, head_dim: int, dtype: torch.dtype) -> float:
    """Seconds of one batch's SDPA over `length` tokens per crop (best of 2)."""
    q = torch.randn(BATCH, heads, length, head_dim, dtype=dtype)
    with torch.inference_mode():
        return _best(lambda: F.scaled_dot_product_attention(q, q, q))


Encoder = Callable[[torch.Tensor], torch.Tensor]


def encoders(bench: TowerBench, model_dir: Path, dtype: torch.dtype) -> dict[str, Encoder]:
    """name -> pixels [8, 3, S, S] -> rows [8 * tokens, width], each loaded from the same checkpoint in `dtype`."""
    from transformers import AutoModelForImageTextToText

    from eric_epd.models.facts import generic_tower
    from eric_epd.models.hf.encoder import HFVisionEncoder

    tower = generic_tower(bench.family).ENCODER.load(model_dir, dtype, "cpu")
    generic = HFVisionEncoder.load(model_dir, dtype, "cpu")
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    rows = [bench.tokens] * BATCH
    return {
        "transformers": lambda px: full.get_image_features(pixel_values=px.to(dtype)).pooler_output.flatten(0, 1),
        "generic": lambda px: torch.cat(generic.encode({"pixel_values": px}, rows)),
        "tower": lambda px: torch.cat(tower.encode({"pixel_values": px}, rows)),
    }


def profile(fn: Encoder, px: torch.Tensor, top: int = 8) -> list[dict]:
    """One batch under torch.profiler: the `top` ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        fn(px)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in events
    ]


def measure(bench: TowerBench, model_dir: Path, dtype: torch.dtype, rounds: int) -> dict:
    """Every encoder on the same batch, interleaved for `rounds` rounds after a warm-up; rows checked alike."""
    fns = encoders(bench, model_dir, dtype)
    px = torch.rand(BATCH, 3, bench.image_size, bench.image_size, generator=torch.Generator().manual_seed(0))
    px = px * 2 - 1
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        rows = {name: fn(px) for name, fn in fns.items()}  # warm-up, and the rows compared below
        ref = rows["transformers"].float()
        errors = {name: float((r.float() - ref).abs().max() / ref.abs().max()) for name, r in rows.items()}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(px)
                times[name].append(time.perf_counter() - start)
    out: dict = {"floor_s": bench.floor(dtype), "matmul_flops": matmul_flops(dtype), "encoders": {}}
    for name, ts in times.items():
        median = statistics.median(ts)
        out["encoders"][name] = {
            "images_per_s": BATCH / median,
            "median_batch_s": median,
            "batch_s": ts,
            "rel_err_vs_transformers": errors[name],
            "fraction_of_floor": out["floor_s"] / median,
        }
    generic = out["encoders"]["generic"]["images_per_s"]
    out["ratio_vs_generic"] = {name: e["images_per_s"] / generic for name, e in out["encoders"].items()}
    out["profile"] = {name: profile(fns[name], px) for name in ("tower", "generic")}
    return out


def plot(bench: TowerBench, results: dict, path: Path) -> None:
    """Bars of images/s per encoder, one panel per dtype, labelled with the ratio to the generic path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (dtype, run) in zip(axes[0], runs.items()):
        names = list(run["encoders"])
        values = [run["encoders"][n]["images_per_s"] for n in names]
        ax.bar(names, values, color=["tab:gray", "tab:blue", "tab:orange"])
        for i, n in enumerate(names):
            ax.text(i, values[i], f"{run['ratio_vs_generic'][n]:.2f}x", ha="center", va="bottom")
        ax.axhline(BATCH / run["floor_s"], color="k", ls="--", lw=1, label="GEMM + attention floor")
        ax.set_ylabel("images/s (1 crop each, batches of 8)")
        ax.set_title(f"{bench.title} vision encoders, {dtype}")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(bench: TowerBench, dtypes: list[str], rounds: int) -> dict:
    """Measure per dtype on Eric's half of the host, write the JSON and PNG, log the table."""
    model_dir = ensure_built(bench.checkpoint, "config.json", bench.build)
    cpus = host_split()[0]
    results: dict = {
        "checkpoint": f"{bench.family} bench at {model_dir.relative_to(cache_root())} (offline random)",
        "scale": bench.scale,
        "batch": BATCH,
        "cpus": list(cpus),
        "torch_threads": len(cpus),
        "rounds": rounds,
        "runs": {},
    }
    with on_cpus(cpus):
        for name in dtypes:
            logger.info("%s encoders, %s, %d rounds of %d crops", bench.family, name, rounds, BATCH)
            results["runs"][name] = measure(bench, model_dir, getattr(torch, name), rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"encoder_throughput_{bench.family}.json").write_text(json.dumps(results, indent=2))
    plot(bench, results, RESULTS / f"encoder_throughput_{bench.family}.png")
    lines = [
        f"{'dtype':9} {'encoder':13} {'img/s':>7} {'batch s':>8} {'vs generic':>10} {'of floor':>8} {'rel err':>8}"
    ]
    for name, run in results["runs"].items():
        for enc, r in run["encoders"].items():
            lines.append(
                f"{name:9} {enc:13} {r['images_per_s']:7.2f} {r['median_batch_s']:8.3f} "
                f"{run['ratio_vs_generic'][enc]:9.2f}x {r['fraction_of_floor']:8.2f} "
                f"{r['rel_err_vs_transformers']:8.1e}"
            )
    logger.info("results (%s)\n%s", bench.scale, "\n".join(lines))
    return results
