"""Gemma 3's vision encoders on batches of 8 crops (concurrency 8): Eric's own tower (models/gemma3.py, behind the
generic runner's interface), the generic path's encoder (models/hf HFVisionEncoder: transformers' classes, vision
only) and transformers' full model's get_image_features; in process, same dtype, same CPUs and threads.

The checkpoint is Gemma-3-shaped but scaled down to run on one CPU core in about a minute (see SCALE). Pixels are
random crops in [-1, 1] (what the processor's normalisation gives); processing, HTTP and transfer are left out (they
are the same on both of Eric's paths; benchmarks/eric_overhead.py measures them). Each round runs one batch of each
implementation in turn (so drift hits all three alike); images/s is 8 / the median batch time. Also: the floor of
the tower's own GEMMs and attention alone (same shapes), and a one-batch torch.profiler table of each encoder.
Run as `python benchmarks/encoder_throughput.py --family gemma3`; writes
benchmarks/results/encoder_throughput_gemma3.{json,png}.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from encoder_throughput import RESULTS, matmul_flops, on_cpus  # a sibling script (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import cache_root, ensure_built
from eric_epd.stack.servers import host_split

logger = logging.getLogger("encoder_throughput")

BATCH = 8
"""Crops per forward: concurrency 8 of one-crop images, as Eric's scheduler joins them."""
VISION = {"model_type": "siglip_vision_model", "hidden_size": 432, "intermediate_size": 1614,
          "num_hidden_layers": 4, "num_attention_heads": 6, "image_size": 448, "patch_size": 14,
          "vision_use_head": False}
"""SigLIP-So400m/14 at 896 px as in Gemma 3 (width 1152 = 16 heads of 72, MLP 4304, 27 layers, 64x64 patches pooled
4x4 to 256 tokens) scaled down: width 432 = 6 heads of 72 (0.375x), MLP 1614 (the same 3.74 ratio), 4 layers, 448 px
(32x32 = 1024 patches, pooled 4x4 to 64 tokens: the same pooling)."""
TOKENS, TEXT_WIDTH = 64, 640
SCALE = ("SigLIP-So400m/14 (Gemma 3) scaled: width 432 (6 heads of 72), MLP 1614, 4 layers, 448 px crops "
         "(1024 patches) pooled 4x4 to 64 tokens of width 640")


def build(out: Path) -> None:
    """A random Gemma 3 checkpoint of these dimensions (a one-layer language model: get_image_features never runs
    it); constant-initialised tensors (the zero projection) get noise so rows are not all zero."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {"model_type": "gemma3_text", "hidden_size": TEXT_WIDTH, "intermediate_size": 1280,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
            "vocab_size": 1024}
    cfg = Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=TOKENS, image_token_index=1000,
                       boi_token_index=1001, eoi_token_index=1002)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(out)


def encoders(model_dir: Path, dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> pixels [8, 3, 448, 448] -> rows [8 * 64, 640], each loaded from the same checkpoint in `dtype`."""
    from transformers import AutoModelForImageTextToText

    from eric_epd.models.gemma3 import Gemma3Encoder
    from eric_epd.models.hf.encoder import HFVisionEncoder

    tower = Gemma3Encoder.load(model_dir, dtype, "cpu")
    generic = HFVisionEncoder.load(model_dir, dtype, "cpu")
    full = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    rows = [TOKENS] * BATCH
    return {
        "transformers": lambda px: full.get_image_features(pixel_values=px.to(dtype)).pooler_output.flatten(0, 1),
        "generic": lambda px: torch.cat(generic.encode({"pixel_values": px}, rows)),
        "tower": lambda px: torch.cat(tower.encode({"pixel_values": px}, rows)),
    }


def floor_s(dtype: torch.dtype) -> float:
    """Seconds the tower's own linear layers and attention take alone for one batch (best of 2 per shape, F.linear
    with bias and SDPA on the same shapes): no implementation can beat it; norms, activations and copies add on."""
    n, d, mlp, heads, layers = BATCH * 1024, VISION["hidden_size"], VISION["intermediate_size"], 6, 4

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def linear(rows: int, k: int, out: int) -> float:
        x, w, b = torch.randn(rows, k, dtype=dtype), torch.randn(out, k, dtype=dtype), torch.randn(out, dtype=dtype)
        return best(lambda: F.linear(x, w, b))

    with torch.inference_mode():
        q = torch.randn(BATCH, heads, 1024, d // heads, dtype=dtype)
        per_layer = (linear(n, d, 3 * d) + linear(n, d, d) + linear(n, d, mlp) + linear(n, mlp, d)
                     + best(lambda: F.scaled_dot_product_attention(q, q, q)))
        patch = linear(n, 3 * 14 * 14, d)  # the patch conv as a GEMM
        return patch + layers * per_layer + linear(BATCH * TOKENS, d, TEXT_WIDTH)


def profile(fn: Callable[[torch.Tensor], torch.Tensor], px: torch.Tensor, top: int = 8) -> list[dict]:
    """One batch under torch.profiler: the `top` ops by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        fn(px)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events]


def measure(model_dir: Path, dtype: torch.dtype, rounds: int) -> dict:
    """Every encoder on the same batch, interleaved for `rounds` rounds after a warm-up; rows checked alike."""
    fns = encoders(model_dir, dtype)
    px = torch.rand(BATCH, 3, VISION["image_size"], VISION["image_size"], generator=torch.Generator().manual_seed(0))
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
    out: dict = {"floor_s": floor_s(dtype), "matmul_flops": matmul_flops(dtype), "encoders": {}}
    for name, ts in times.items():
        median = statistics.median(ts)
        out["encoders"][name] = {"images_per_s": BATCH / median, "median_batch_s": median, "batch_s": ts,
                                 "rel_err_vs_transformers": errors[name], "fraction_of_floor": out["floor_s"] / median}
    generic = out["encoders"]["generic"]["images_per_s"]
    out["ratio_vs_generic"] = {name: e["images_per_s"] / generic for name, e in out["encoders"].items()}
    out["profile"] = {name: profile(fns[name], px) for name in ("tower", "generic")}
    return out


def plot(results: dict, path: Path) -> None:
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
        ax.set_title(f"Gemma 3 vision encoders, {dtype}")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(dtypes: list[str], rounds: int) -> dict:
    """Measure per dtype on Eric's half of the host, write the JSON and PNG, log the table."""
    model_dir = ensure_built("gemma3-bench-s0-v1", "config.json", build)
    cpus = host_split()[0]
    results: dict = {"checkpoint": f"gemma3 bench at {model_dir.relative_to(cache_root())} (offline random)",
                     "scale": SCALE, "batch": BATCH, "cpus": list(cpus), "torch_threads": len(cpus),
                     "rounds": rounds, "runs": {}}
    with on_cpus(cpus):
        for name in dtypes:
            logger.info("gemma3 encoders, %s, %d rounds of %d crops", name, rounds, BATCH)
            results["runs"][name] = measure(model_dir, getattr(torch, name), rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "encoder_throughput_gemma3.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / "encoder_throughput_gemma3.png")
    lines = [f"{'dtype':9} {'encoder':13} {'img/s':>7} {'batch s':>8} {'vs generic':>10} {'of floor':>8} "
             f"{'rel err':>8}"]
    for name, run in results["runs"].items():
        for enc, r in run["encoders"].items():
            lines.append(f"{name:9} {enc:13} {r['images_per_s']:7.2f} {r['median_batch_s']:8.3f} "
                         f"{run['ratio_vs_generic'][enc]:9.2f}x {r['fraction_of_floor']:8.2f} "
                         f"{r['rel_err_vs_transformers']:8.1e}")
    logger.info("results (%s)\n%s", SCALE, "\n".join(lines))
    return results
