"""EPD against colocated vLLM on the same cores, loaded by `vllm bench serve`: TTFT/TPOT p50/p99, throughput and
goodput under an SLO, over a sweep of request rates, for encoder-heavy, single-image and repeated-image traffic; and
multi-turn chats that resend earlier images (benchmarks/multiturn.py's driver): per turn TTFT p50 and its work.

Colocated: one `vllm serve` on every core. EPD: Eric (and the gateway) on one half of the cores, vLLM behind Eric
on the other (`eric-epd up`'s layout, its content cache included).
Writes benchmarks/results/epd_vs_colocated.{json,png}.
Usage: python benchmarks/epd_vs_colocated.py [--quick] [--series heavy,single,repeat,tiny,multiturn] [--rates 0.5,inf]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
from multiturn import Load, driver, print_turns  # a sibling script (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus
from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe, host_split
from eric_epd.stack.up import UpConfig
from eric_epd.testing.media import image_bytes, random_image

logger = logging.getLogger("epd_vs_colocated")
RESULTS = Path(__file__).parent / "results"
OUTPUT_TOKENS = 32
MAX_MODEL_LEN = 8192  # the offline checkpoints' max_position_embeddings
SLO = {"ttft": 8000.0, "tpot": 400.0}
"""Goodput SLO in ms (a request counts when both hold): generous for a 2-core CPU running the small checkpoint."""


@dataclass(frozen=True)
class Series:
    """One traffic series: its checkpoint size, `vllm bench serve` dataset and most images per prompt."""
    name: str
    checkpoint: str
    """size of the offline qwen2_vl checkpoint"""
    dataset: list[str]
    """`vllm bench serve` dataset arguments"""
    max_images: int
    prepare: Callable[[int], None] | None = None
    """Writes the dataset file of one run (its seed replaces "{seed}" in `dataset`)."""
    driver: Callable[[str, str, dict[str, str], int], dict] | None = None
    """Runs the series itself, once, instead of `vllm bench serve` at each rate: (base URL, key, metric servers by
    role, seed) -> its results."""


def _buckets(sides: tuple[int, ...]) -> str:
    return "{" + ", ".join(f"({s}, {s}, 1): {1 / len(sides):.4f}" for s in sides) + "}"


def _random_mm(items: int, spread: float, sides: tuple[int, ...], limit: int) -> list[str]:
    return ["--dataset-name", "random-mm", "--random-input-len", "64", "--random-output-len", str(OUTPUT_TOKENS),
            "--random-mm-base-items-per-request", str(items), "--random-mm-num-mm-items-range-ratio", str(spread),
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": limit, "video": 0}),
            "--random-mm-bucket-config", _buckets(sides)]


def repeat_dataset(path: Path, prompts: int, per_request: int, sides: tuple[int, int], seed: int = 0) -> None:
    """custom_image JSONL: half of each request's images come from a small shared set (they repeat); the other half
    are new to this run (named by its seed)."""
    images = path.parent / "images"
    images.mkdir(parents=True, exist_ok=True)

    def image(name: str, i: int) -> str:
        side = sides[i % len(sides)]
        f = images / f"{name}_{i}.png"
        if not f.exists():
            salt = zlib.crc32(name.encode()) % 997
            f.write_bytes(image_bytes(random_image(side, side, seed=seed * 100_003 + salt * 101 + i)))
        return str(f)

    shared = [image("shared", i) for i in range(per_request)]
    with path.open("w") as out:
        for p in range(prompts):
            fresh = [image(f"fresh{seed}_{p}", i) for i in range(per_request - per_request // 2)]
            files = shared[: per_request // 2] + fresh
            out.write(json.dumps({"prompt": "Describe these images.", "image_files": files}) + "\n")


def make_series(quick: bool, tmp: Path, prompts: int) -> dict[str, Series]:
    """The traffic series by name: heavy, single, repeat (a dataset file written per run), tiny and multiturn (its
    own driver: 3-turn chats, `prompts` conversations of each shape, half of them at a time)."""
    heavy_sides = (224, 448) if quick else (224, 448, 672)  # 8 images of 896 px would pass the 8192-token context
    repeat = tmp / "repeat_{seed}.jsonl"

    def prepare_repeat(seed: int) -> None:
        repeat_dataset(Path(str(repeat).replace("{seed}", str(seed))), max(prompts, 4), 4, (224, 448), seed)

    return {
        "heavy": Series("heavy", "small", _random_mm(6, 0.34, heavy_sides, 8), 8),
        "single": Series("single", "small", _random_mm(1, 0.0, (224, 448), 1), 8),
        "repeat": Series("repeat", "small", ["--dataset-name", "custom_image", "--dataset-path", str(repeat),
                                             "--custom-output-len", str(OUTPUT_TOKENS),
                                             "--custom-ensure-client-side-data"], 8, prepare_repeat),
        "tiny": Series("tiny", "tiny", _random_mm(3, 0.0, (56, 112, 224), 3), 4),
        "multiturn": Series("multiturn", "small", [], 4, driver=driver(
            Load(prompts, max(prompts // 2, 1), OUTPUT_TOKENS), Load(2, 2, OUTPUT_TOKENS))),
    }


# ---- systems --------------------------------------------------------------------------------------------------


def start_colocated(stack: ExitStack, model: Path, series: Series, logs: Path) -> tuple[str, str, dict[str, str]]:
    """One `vllm serve` on every core, its own encoder: (base URL, API key, base URLs of its metrics by role)."""
    vllm = stack.enter_context(VllmServe(model, logs / "colocated_vllm.log", cpus=available_cpus(),
                                         extra=vllm_extra(series), max_model_len=MAX_MODEL_LEN))
    return vllm.url, vllm.api_key, {"vllm": vllm.url}


def start_epd(stack: ExitStack, model: Path, series: Series, logs: Path) -> tuple[str, str, dict[str, str]]:
    """Eric + gateway on one half of the cores, vLLM behind Eric on the other: (gateway URL, key, base URLs of the
    servers' metrics by role)."""
    eric_cpus, engine_cpus = host_split()
    eric = stack.enter_context(EricServer(model, cpus=eric_cpus, log_path=logs / "epd_eric.log",
                                          extra_args=("--keep-acked-bytes", str(UpConfig.keep_acked_bytes))))
    vllm = stack.enter_context(VllmServe(model, logs / "epd_vllm.log", eric_urls=[eric.url], eric_api_key=eric.api_key,
                                         cpus=engine_cpus, extra=vllm_extra(series), max_model_len=MAX_MODEL_LEN))
    gateway = stack.enter_context(GatewayServer(
        logs / "epd_gateway.log", "--encoder-urls", eric.url, "--colocated-urls", vllm.url,
        eric_api_key=eric.api_key, upstream_api_key=vllm.api_key, api_key="bench", cpus=eric_cpus))
    return gateway.url, "bench", {"eric": eric.url, "gateway": gateway.url, "vllm": vllm.url}


def vllm_extra(series: Series) -> tuple[str, ...]:
    """The vLLM flags every run of a series gets: 16 sequences, a seed, and the series' image limit."""
    return ("--max-num-seqs", "16", "--seed", "0", "--limit-mm-per-prompt",
            json.dumps({"image": series.max_images, "video": 0}))


# ---- load -----------------------------------------------------------------------------------------------------


def bench(url: str, key: str, model: Path, series: Series, rate: float, prompts: int, out: Path, seed: int) -> dict:
    """One `vllm bench serve` run against an OpenAI chat endpoint; its saved result. Each run of a side has its own
    `seed` (its own random images), so no run reuses another's images through a cache."""
    vllm = str(Path(sys.executable).parent / "vllm")
    if series.prepare is not None:
        series.prepare(seed)
    dataset = [a.replace("{seed}", str(seed)) for a in series.dataset]
    cmd = [vllm, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", url, "--model", str(model), "--tokenizer", str(model), *dataset,
           "--num-prompts", str(prompts), "--request-rate", "inf" if rate == float("inf") else str(rate),
           "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
           "50,99", "--goodput", f"ttft:{SLO['ttft']}", f"tpot:{SLO['tpot']}", "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]
    env = os.environ | {"OPENAI_API_KEY": key}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600)
    return json.loads(out.read_text())


def stage_means(server_url: str, prefix: str) -> dict[str, float]:
    """Mean seconds per stage from a server's Prometheus histogram family `<prefix>_seconds{stage=...}`."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in httpx.get(server_url + "/metrics", timeout=30).text.splitlines():
        for kind, into in (("_seconds_sum{", sums), ("_seconds_count{", counts)):
            if line.startswith(prefix + kind) and 'stage="' in line:
                stage = line.split('stage="')[1].split('"')[0]
                into[stage] = into.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return {s: sums[s] / counts[s] for s in sums if counts.get(s)}


KEYS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "request_throughput", "output_throughput",
        "request_goodput", "completed")


def run_rates(url: str, key: str, model: Path, series: Series, rates: list[float], prompts: int, logs: Path,
              side: str) -> dict:
    """A warm-up, then `vllm bench serve` at each rate: the results by rate."""
    bench(url, key, model, series, float("inf"), 4, logs / f"{side}_{series.name}_warmup.json", seed=1000)
    runs = {}
    for i, rate in enumerate(rates):
        result = bench(url, key, model, series, rate, prompts, logs / f"{side}_{series.name}_{rate}.json", seed=i)
        runs[str(rate)] = {k: result.get(k) for k in KEYS}
        logger.info("%s %s rate %s: %s", side, series.name, rate, runs[str(rate)])
    return runs


def run_side(side: str, series: Series, rates: list[float], prompts: int, logs: Path, family: str) -> dict:
    """One side (colocated or EPD) of a series: `vllm bench serve` at each rate, or the series' own driver once (its
    results under "turns"); and EPD's stages."""
    model = ensure_checkpoint(family, series.checkpoint)
    with ExitStack() as stack:
        start = start_colocated if side == "colocated" else start_epd
        url, key, metrics = start(stack, model, series, logs)
        if series.driver is None:
            runs = run_rates(url, key, model, series, rates, prompts, logs, side)
        else:
            runs = {"turns": series.driver(url, key, metrics, 0)}
            logger.info("%s %s: %s", side, series.name, runs["turns"])
        if "eric" in metrics:
            runs["stages_s"] = {"eric": stage_means(metrics["eric"], "eric_stage"),
                                "gateway": stage_means(metrics["gateway"], "gateway_stage")}
    return runs


# ---- report ---------------------------------------------------------------------------------------------------


def ratios(results: dict) -> dict:
    """EPD over colocated per series and rate: TTFT p50/p99, TPOT p99, throughput and goodput."""
    out: dict = {}
    for name, sides in results["runs"].items():
        for rate, epd in sides["epd"].items():
            col = sides["colocated"].get(rate)
            if rate in ("stages_s", "turns") or not col:
                continue
            out.setdefault(name, {})[rate] = {
                k: (epd[k] / col[k]) if epd.get(k) and col.get(k) else None
                for k in ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "output_throughput", "request_goodput")}
    return out


def print_table(results: dict) -> None:
    """Print the ratios as a table, one row per series and rate."""
    cols = ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "output_throughput", "request_goodput")
    lines = [f"{'series':8} {'rate':>6} | " + " ".join(f"{c:>18}" for c in cols)]
    for name, by_rate in results["ratios"].items():
        for rate, r in by_rate.items():
            lines.append(f"{name:8} {rate:>6} | " + " ".join(f"{r[c]:18.2f}" if r[c] else f"{'-':>18}" for c in cols))
    lines.append("EPD/colocated ratios: below 1 is better for TTFT/TPOT, above 1 for throughput and goodput")
    print("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    """TTFT, TPOT and goodput against request rate, both sides, one row of panels per series, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results["runs"] if "turns" not in results["runs"][n]["epd"]]  # rate sweeps only
    if not names:
        return
    panels = (("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"),
              ("request_goodput", "goodput (req/s)"))
    fig, axes = plt.subplots(len(names), len(panels), figsize=(15, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for side in ("colocated", "epd"):
                rates = [r for r in results["runs"][name][side] if r != "stages_s"]
                xs = [float(r) if r != "inf" else max(float(x) for x in rates if x != "inf") * 2 for r in rates]
                ax.plot(xs, [results["runs"][name][side][r][key] or 0 for r in rates], "o-", label=side)
            ax.set_xlabel("request rate (req/s; rightmost: all at once)")
            ax.set_title(f"{name}: {label}")
            ax.legend()
    fig.suptitle(f"EPD vs colocated vLLM, {os.cpu_count()} CPU cores, SLO TTFT {SLO['ttft']:.0f} ms / TPOT "
                 f"{SLO['tpot']:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    """Run every series on both sides, and write the results and plot and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="images up to 448 px, 8 prompts per rate, two rates")
    ap.add_argument("--series", default="heavy,single,repeat,tiny", help="comma-separated traffic series to run")
    ap.add_argument("--rates", default=None, help="comma-separated requests/s ('inf': all at once)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per point (default: each series' own)")
    ap.add_argument("--tag", default="", help="suffix of the result files (epd_vs_colocated<tag>.json/.png)")
    ap.add_argument("--family", default="qwen2_vl", help="the offline checkpoints' family (any the builder has)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rates = [float(r) for r in (args.rates or ("0.5,inf" if args.quick else "0.25,0.5,1,2,inf")).split(",")]
    prompts = args.prompts or (8 if args.quick else 32)
    RESULTS.mkdir(exist_ok=True)
    start = time.perf_counter()
    logs = RESULTS / "epd_vs_colocated_logs"  # server logs and vllm bench results, kept for inspection
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        catalogue = make_series(args.quick, Path(tmp), prompts)
        results: dict = {"slo_ms": SLO, "output_tokens": OUTPUT_TOKENS, "prompts_per_rate": prompts,
                         "cpu_cores": os.cpu_count(), "rates": rates,
                         "layout": {"colocated": "vllm serve on every core",
                                    "epd": "Eric + gateway on one half of the cores, vLLM behind Eric on the other"},
                         "series": {}, "runs": {}}
        for name in args.series.split(","):
            series = catalogue[name]
            results["series"][name] = {"checkpoint": f"{args.family} {series.checkpoint}", "dataset": series.dataset}
            results["runs"][name] = {side: run_side(side, series, rates, prompts, logs, args.family)
                                     for side in ("colocated", "epd")}
    results["ratios"] = ratios(results)
    for name, sides in results["runs"].items():
        if "turns" in sides["epd"]:
            print_turns(name, sides)
    results["wall_s"] = time.perf_counter() - start
    (RESULTS / f"epd_vs_colocated{args.tag}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"epd_vs_colocated{args.tag}.png")
    print_table(results)


if __name__ == "__main__":
    main()
