"""Eric's Qwen vision tower run eagerly against `--compile inductor` (models/layers/compiled.py), in process on one CPU
core and one torch thread: images/s for batches of 1, 4 and 8 images of 224 and 448 px, float32 and bfloat16, on the
offline *small* checkpoints (8 blocks of width 512). Each case times both towers alternately (best of `--rounds`)
and reports the compiled rows' error against the eager ones, and both against the tower in float64.
Writes benchmarks/results/encoder_compile.{json,png} (a family not run keeps its earlier rows).
Usage: python benchmarks/encoder_compile.py [--family qwen2_5_vl qwen2_vl] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus, pin_torch
from eric_epd.models.registry import load_encoder
from eric_epd.testing.exactness import relative_error

logger = logging.getLogger("encoder_compile")
RESULTS = Path(__file__).parent / "results"
BATCHES = (1, 4, 8)
SIDES = (224, 448)
DTYPES = ("float32", "bfloat16")


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), or the machine type."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def _seconds(encoder: torch.nn.Module, pixels: torch.Tensor, grid: list[tuple[int, int, int]]) -> float:
    start = time.perf_counter()
    encoder(pixels, grid)
    return time.perf_counter() - start


def measure_case(
    eager: torch.nn.Module, compiled: torch.nn.Module, exact: torch.nn.Module, images: int, side: int, rounds: int
) -> dict:
    """One batch of `images` square images of `side` px through both towers: images/s (best of `rounds`, the
    towers alternating) and the compiled rows' error."""
    cells = side // eager.patch_size
    grid = [(1, cells, cells)] * images
    generator = torch.Generator().manual_seed(side)
    pixels = torch.randn(images * cells * cells, eager.patch_embed.in_dim, generator=generator)
    rows64 = exact(pixels.double(), grid)
    ours, theirs = compiled(pixels, grid), eager(pixels, grid)  # also each tower's first run at this size
    error = relative_error(ours, theirs)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name, encoder in (("eager", eager), ("compiled", compiled)):
            times[name].append(_seconds(encoder, pixels, grid))
    eager_ips, compiled_ips = images / min(times["eager"]), images / min(times["compiled"])
    return {
        "images": images,
        "side": side,
        "eager_img_s": eager_ips,
        "compiled_img_s": compiled_ips,
        "gain": compiled_ips / eager_ips - 1,
        "rel_err": error,
        "compiled_rel_err_float64": relative_error(ours, rows64),
        "eager_rel_err_float64": relative_error(theirs, rows64),
    }


def run_family(family: str, cases: list[tuple[int, int]], rounds: int) -> dict:
    """Every dtype's cases for one family's small checkpoint; the compile's own seconds too."""
    checkpoint = ensure_checkpoint(family, "small")
    exact = load_encoder(checkpoint, torch.float64, "cpu")  # the reference both towers' errors are measured from
    out = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        eager, compiled = load_encoder(checkpoint, dtype, "cpu"), load_encoder(checkpoint, dtype, "cpu")
        start = time.perf_counter()
        compiled.compile_parts()
        compile_s = time.perf_counter() - start
        rows = []
        for images, side in cases:
            rows.append(measure_case(eager, compiled, exact, images, side, rounds))
            logger.info(
                "%s %s %dx%d: eager %.2f img/s, compiled %.2f (%+.1f%%), rel err %.1e",
                family,
                name,
                images,
                side,
                rows[-1]["eager_img_s"],
                rows[-1]["compiled_img_s"],
                100 * rows[-1]["gain"],
                rows[-1]["rel_err"],
            )
        out[name] = {"compile_s": compile_s, "cases": rows}
    return out


def plot(results: dict, path: Path) -> None:
    """Eager and compiled images/s per case, one panel per family and dtype, each pair labelled with its gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = results["families"]
    fig, axes = plt.subplots(len(families), len(DTYPES), figsize=(6 * len(DTYPES), 3.6 * len(families)), squeeze=False)
    for row, (family, runs) in zip(axes, families.items()):
        for ax, (dtype, run) in zip(row, runs.items()):
            cases = run["cases"]
            xs = range(len(cases))
            ax.bar([x - 0.2 for x in xs], [c["eager_img_s"] for c in cases], 0.4, label="eager", color="tab:gray")
            ax.bar([x + 0.2 for x in xs], [c["compiled_img_s"] for c in cases], 0.4, label="inductor", color="tab:blue")
            for x, c in zip(xs, cases):
                ax.text(x + 0.2, c["compiled_img_s"], f"{100 * c['gain']:+.0f}%", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(list(xs), [f"{c['images']}x{c['side']}" for c in cases])
            ax.set_ylabel("images/s, 1 core")
            ax.set_title(f"{family} small, {dtype} (compile {run['compile_s']:.0f}s)")
            ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(families: list[str], rounds: int, quick: bool) -> dict:
    """Pin to one core, measure, merge into the results file (other families' rows kept), plot."""
    cpu = available_cpus()[-1]
    pin_torch((cpu,))
    cases = [(b, s) for s in SIDES for b in ((1, 4) if quick else BATCHES)]
    path = RESULTS / "encoder_compile.json"
    results = json.loads(path.read_text()) if path.exists() else {"families": {}}
    results.update(
        {
            "cpu": cpu_model(),
            "cpu_pinned": cpu,
            "torch_threads": 1,
            "torch": torch.__version__,
            "rounds": rounds,
            "quick": quick,
            "what": "Qwen tower forward, eager vs --compile inductor (models/layers/compiled.py)",
        }
    )
    for family in families:
        results["families"][family] = run_family(family, cases, rounds)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "encoder_compile.png")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--family",
        nargs="+",
        default=["qwen2_5_vl"],
        choices=["qwen2_vl", "qwen2_5_vl"],
        help="small checkpoints to measure",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per tower and case (best counts)")
    parser.add_argument("--quick", action="store_true", help="batches of 1 and 4 only")
    args = parser.parse_args()
    main(args.family, args.rounds, args.quick)
