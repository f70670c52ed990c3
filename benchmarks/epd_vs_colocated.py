"""EPD against colocated vLLM on the same cores, loaded by `vllm bench serve`: TTFT/TPOT p50/p99, throughput and
goodput under an interactive SLO, over request rates up to saturation, each point `--runs` times (medians and
spread), on checkpoints shaped like Qwen2.5-VL-3B and -7B (planning/costs.py), both sides in float32.

Colocated: one `vllm serve` on every core. EPD: Eric (and the gateway) on one half of the cores, vLLM behind Eric
on the other (`eric-epd up`'s layout, its content cache included). Before the runs `eric-epd profile` measures Eric
alone and the engine alone on those shares (and the engine on all cores): from it the planner predicts every point
(its error is reported) and the pipeline efficiency is EPD's saturated throughput over the smaller capacity alone.
The multiturn series (benchmarks/multiturn.py's driver, small checkpoint) runs 3-turn chats resending earlier images:
per turn TTFT p50 of both sides and EPD's encodes and transfers.
Writes benchmarks/results/epd_vs_colocated<tag>.{json,png}.
Usage: python benchmarks/epd_vs_colocated.py [--quick] [--size shaped3b] [--series mix,heavy,multiturn] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
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
import msgspec
from epd_report import KEYS, pipeline_efficiency, plot, prediction_errors, print_table, ratios, summarize
from multiturn import Load, driver, print_turns  # sibling scripts (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus
from eric_epd.planning.planner import Layout, PlanConfig, predict
from eric_epd.planning.profiler import ProfileConfig, profile
from eric_epd.planning.profiles import Profile, Slo, Traffic, read_profile
from eric_epd.planning.simulate import EngineModel, tokens_per_item
from eric_epd.stack.servers import EricServer, GatewayServer, LocalServers, VllmServe, host_split
from eric_epd.stack.up import UpConfig
from eric_epd.testing.media import image_bytes, random_image

logger = logging.getLogger("epd_vs_colocated")
RESULTS = Path(__file__).parent / "results"
OUTPUT_TOKENS = 32
MAX_MODEL_LEN = 8192  # the offline checkpoints' max_position_embeddings
SLO = {"ttft": 10000.0, "tpot": 100.0}
"""Goodput SLO in ms (a request counts when both hold). TPOT 100 ms is ten tokens a second, about reading speed: the
bound an interactive chat needs. TTFT 10 s: a CPU encodes four images of a 3B-shaped model in about a second per
core, so queueing at saturation is what the bound separates."""


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
    limits: dict[str, int] | None = None
    """vLLM's --limit-mm-per-prompt (default: `max_images` images, no video)"""
    gateway_args: tuple[str, ...] = ()
    """Extra flags of EPD's gateway"""


def _buckets(sides: tuple[int, ...]) -> str:
    return "{" + ", ".join(f"({s}, {s}, 1): {1 / len(sides):.4f}" for s in sides) + "}"


def _random_mm(items: int, spread: float, sides: tuple[int, ...], limit: int) -> list[str]:
    return [
        "--dataset-name",
        "random-mm",
        "--random-input-len",
        "64",
        "--random-output-len",
        str(OUTPUT_TOKENS),
        "--random-mm-base-items-per-request",
        str(items),
        "--random-mm-num-mm-items-range-ratio",
        str(spread),
        "--random-mm-limit-mm-per-prompt",
        json.dumps({"image": limit, "video": 0}),
        "--random-mm-bucket-config",
        _buckets(sides),
    ]


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


def make_series(quick: bool, tmp: Path, prompts: int, size: str) -> dict[str, Series]:
    """The traffic series by name: mix (the headline: 4 images of 224 or 448 px), heavy (encoder-heavy: 4-8 images
    up to 672 px), single, repeat (a dataset file written per run; half of each request's images repeat), tiny and
    multiturn (its own driver: 3-turn chats, `prompts` conversations of each shape, half of them at a time)."""
    heavy_sides = (224, 448) if quick else (224, 448, 672)  # 8 images of 896 px would pass the 8192-token context
    repeat = tmp / "repeat_{seed}.jsonl"

    def prepare_repeat(seed: int) -> None:
        repeat_dataset(Path(str(repeat).replace("{seed}", str(seed))), max(prompts, 4), 4, (224, 448), seed)

    return {
        "mix": Series("mix", size, _random_mm(4, 0.0, (224, 448), 4), 4),
        "heavy": Series("heavy", size, _random_mm(6, 0.34, heavy_sides, 8), 8),
        "single": Series("single", size, _random_mm(1, 0.0, (224, 448), 1), 8),
        "repeat": Series(
            "repeat",
            size,
            [
                "--dataset-name",
                "custom_image",
                "--dataset-path",
                str(repeat),
                "--custom-output-len",
                str(OUTPUT_TOKENS),
                "--custom-ensure-client-side-data",
            ],
            8,
            prepare_repeat,
        ),
        "tiny": Series("tiny", "tiny", _random_mm(3, 0.0, (56, 112, 224), 3), 4),
        "multiturn": Series(
            "multiturn",
            "small",
            [],
            4,
            driver=driver(Load(prompts, max(prompts // 2, 1), OUTPUT_TOKENS), Load(2, 2, OUTPUT_TOKENS)),
        ),
    }


def traffic_of(series: Series) -> Traffic:
    """The planner's view of a random-mm series: its items per request and sides, 64 text tokens, the output."""
    i = series.dataset.index("--random-mm-bucket-config")
    sides = tuple(int(side) for side in re.findall(r"\((\d+), \d+, 1\)", series.dataset[i + 1]))
    items = int(series.dataset[series.dataset.index("--random-mm-base-items-per-request") + 1])
    return Traffic(items, sides, 64, OUTPUT_TOKENS)


# ---- systems --------------------------------------------------------------------------------------------------


def start_colocated(stack: ExitStack, model: Path, series: Series, logs: Path) -> tuple[str, str, dict[str, str]]:
    """One `vllm serve` on every core, its own encoder: (base URL, API key, base URLs of its metrics by role)."""
    vllm = stack.enter_context(
        VllmServe(
            model,
            logs / "colocated_vllm.log",
            cpus=available_cpus(),
            extra=vllm_extra(series),
            max_model_len=MAX_MODEL_LEN,
        )
    )
    return vllm.url, vllm.api_key, {"vllm": vllm.url}


def start_epd(stack: ExitStack, model: Path, series: Series, logs: Path) -> tuple[str, str, dict[str, str]]:
    """Eric + gateway on one half of the cores, vLLM behind Eric on the other: (gateway URL, key, base URLs of the
    servers' metrics by role)."""
    eric_cpus, engine_cpus = host_split()
    eric = stack.enter_context(
        EricServer(
            model,
            cpus=eric_cpus,
            log_path=logs / "epd_eric.log",
            extra_args=("--keep-acked-bytes", str(UpConfig.keep_acked_bytes)),
        )
    )
    vllm = stack.enter_context(
        VllmServe(
            model,
            logs / "epd_vllm.log",
            eric_urls=[eric.url],
            eric_api_key=eric.api_key,
            cpus=engine_cpus,
            extra=vllm_extra(series),
            max_model_len=MAX_MODEL_LEN,
        )
    )
    gateway = stack.enter_context(
        GatewayServer(
            logs / "epd_gateway.log",
            "--encoder-urls",
            eric.url,
            "--colocated-urls",
            vllm.url,
            *series.gateway_args,
            eric_api_key=eric.api_key,
            upstream_api_key=vllm.api_key,
            api_key="bench",
            cpus=eric_cpus,
        )
    )
    return gateway.url, "bench", {"eric": eric.url, "gateway": gateway.url, "vllm": vllm.url}


def vllm_extra(series: Series) -> tuple[str, ...]:
    """The vLLM flags every run of a series gets: 16 sequences, a seed, and the series' image limit."""
    return (
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
        "--limit-mm-per-prompt",
        json.dumps(series.limits or {"image": series.max_images, "video": 0}),
    )


# ---- load -----------------------------------------------------------------------------------------------------


def bench(url: str, key: str, model: Path, series: Series, rate: float, prompts: int, out: Path, seed: int) -> dict:
    """One `vllm bench serve` run against an OpenAI chat endpoint; its saved result. Each run of a side has its own
    `seed` (its own random images), so no run reuses another's images through a cache."""
    vllm = str(Path(sys.executable).parent / "vllm")
    if series.prepare is not None:
        series.prepare(seed)
    dataset = [a.replace("{seed}", str(seed)) for a in series.dataset]
    cmd = [
        vllm,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        *dataset,
        "--num-prompts",
        str(prompts),
        "--request-rate",
        "inf" if rate == float("inf") else str(rate),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--goodput",
        f"ttft:{SLO['ttft']}",
        f"tpot:{SLO['tpot']}",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--disable-tqdm",
    ]
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


def run_rates(
    url: str, key: str, model: Path, series: Series, rates: list[float], args: argparse.Namespace, logs: Path, side: str
) -> dict[str, list[dict]]:
    """A warm-up, then `args.runs` rounds of `vllm bench serve` at each rate (each run and rate its own seed: its
    own random images): every run's results by rate."""
    bench(url, key, model, series, float("inf"), 4, logs / f"{side}_{series.name}_warmup.json", seed=1000)
    runs: dict[str, list[dict]] = {}
    for run in range(args.runs):
        for i, rate in enumerate(rates):
            out = logs / f"{side}_{series.name}_{rate}_{run}.json"
            result = bench(url, key, model, series, rate, args.prompts, out, seed=100 * run + i)
            runs.setdefault(str(rate), []).append({k: result.get(k) for k in KEYS})
            logger.info("%s %s run %d rate %s: %s", side, series.name, run, rate, runs[str(rate)][-1])
    return runs


def run_side(side: str, series: Series, model: Path, rates: list[float], args: argparse.Namespace, logs: Path) -> dict:
    """One side (colocated or EPD) of a series: the rate sweep (medians and spread under "points"), or the series'
    own driver once (its results under "turns"); and EPD's stage means."""
    with ExitStack() as stack:
        start = start_colocated if side == "colocated" else start_epd
        url, key, metrics = start(stack, model, series, logs)
        if series.driver is None:
            runs = run_rates(url, key, model, series, rates, args, logs, side)
            out: dict = {"runs": runs, "points": {r: summarize(v) for r, v in runs.items()}}
        else:
            out = {"turns": series.driver(url, key, metrics, 0), "points": {}}
            logger.info("%s %s: %s", side, series.name, out["turns"])
        if "eric" in metrics:
            out["stages_s"] = {
                "eric": stage_means(metrics["eric"], "eric_stage"),
                "gateway": stage_means(metrics["gateway"], "gateway_stage"),
            }
    return out


def profile_shares(model: Path, traffic: Traffic, logs: Path, prompts: int) -> Profile:
    """`eric-epd profile` on EPD's two shares and on every core (the colocated engine's); the engine's capacity alone
    from as many requests at once as a point of the benchmark sends."""
    eric_cpus, engine_cpus = host_split()
    shares = (eric_cpus, engine_cpus) if len(eric_cpus) != len(engine_cpus) else (eric_cpus,)
    return profile(
        ProfileConfig(
            model=model,
            out=logs / "profile.json",
            shares=(*shares, available_cpus()),
            traffic=traffic,
            requests_per_point=8,
            saturation_requests=prompts,
            log_dir=logs / "profile",
        ),
        LocalServers(),
    )


def predictions(prof: Profile, traffic: Traffic, rates: list[float], prompts: int) -> dict[str, dict]:
    """The planner's prediction of each side at each rate (all at once for inf), over as many requests."""
    eric_cpus, engine_cpus = host_split()
    layouts = {
        "epd": Layout(1, len(eric_cpus), 1, len(engine_cpus)),
        "colocated": Layout(0, 0, 1, len(available_cpus())),
    }
    out: dict[str, dict] = {}
    for side, layout in layouts.items():
        for rate in rates:
            mix = msgspec.structs.replace(traffic, rate=0.0 if rate == float("inf") else rate)
            config = PlanConfig(len(available_cpus()), mix, Slo(SLO["ttft"], SLO["tpot"]), requests=prompts, seeds=10)
            out.setdefault(side, {})[str(rate)] = msgspec.to_builtins(predict(prof, layout, config))
    return out


def capacity_alone(prof: Profile, traffic: Traffic) -> dict[str, float]:
    """Requests/s of Eric alone on its share (saturated items/s over items per request) and of the engine alone on
    its share (the mix as embeddings, all at once)."""
    eric_cpus, engine_cpus = host_split()
    eric = max(p.items_per_s for p in prof.share(len(eric_cpus)).eric) / traffic.images_per_request
    return {"eric": eric, "engine": prof.share(len(engine_cpus)).engine.saturated_requests_per_s}


def cost_check(prof: Profile) -> dict[str, float]:
    """The checkpoint's FLOP ratios beside the same ratios in measured seconds on one share: prefill seconds per token
    (the profile's fit) over Eric's seconds per image token (saturated) and over vLLM's own encoder's; decode: TPOT
    per token at the largest batch profiled (after prompts as long as the mix's) over Eric's seconds per image token."""
    share = prof.shares[0]
    eric_s_per_token = 1.0 / (max(p.items_per_s for p in share.eric) * tokens_per_item(prof))
    engine = EngineModel.from_side(share.engine, False, 2048, 16)
    decode = max(share.engine.decode, key=lambda d: (d.batch, d.context_tokens))
    return {
        **{f"flops_{k}": v for k, v in prof.cost_ratios.items()},
        "measured_prefill_over_eric": engine.slope_s / eric_s_per_token,
        "measured_prefill_over_vllm_encoder": engine.slope_s / share.engine.own_encoder_s_per_image_token,
        f"measured_decode_at_batch_{decode.batch}_over_eric": decode.tpot_s / decode.batch / eric_s_per_token,
    }


def run_series(series: Series, args: argparse.Namespace, logs: Path) -> dict:
    """Profile (random-mm series), then both sides, then the derived figures."""
    model = ensure_checkpoint(args.family, series.checkpoint)
    out: dict = {"checkpoint": f"{args.family} {series.checkpoint}", "dataset": series.dataset}
    rates = list(args.rate_list)
    if "--random-mm-bucket-config" in series.dataset and not args.no_profile:
        traffic = traffic_of(series)
        prof = (
            read_profile(args.profile_from)
            if args.profile_from
            else profile_shares(model, traffic, logs / series.name, args.prompts)
        )
        out["profile"] = msgspec.to_builtins(prof)
        out["cost_check"] = cost_check(prof)
        out["capacity_alone"] = capacity_alone(prof, traffic)
        if args.rates is None:  # up to saturation: fractions of the slower side's capacity alone, then all at once
            top = min(out["capacity_alone"].values())
            rates = [round(top * f, 3) for f in (0.5, 0.8, 1.0, 1.25)] + [float("inf")]
        predicted = predictions(prof, traffic, rates, args.prompts)
    else:
        predicted = {}
    for side in ("colocated", "epd"):
        out[side] = run_side(side, series, model, rates, args, logs)
        if side in predicted:
            out[side]["predicted"] = predicted[side]
    out["ratios"] = ratios(out)
    out["prediction_errors"] = prediction_errors(out)
    out["pipeline_efficiency"] = pipeline_efficiency(out)
    if series.driver is not None:
        print_turns(series.name, out)
    return out


def main() -> None:
    """Run every series on both sides, write the results and plot, and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="8 prompts per point, one run, rates 0.5 and all at once")
    ap.add_argument(
        "--series", default="mix,heavy", help="comma-separated traffic series to run (mix, heavy, single, repeat, tiny)"
    )
    ap.add_argument(
        "--size",
        default="shaped3b",
        help="checkpoint size: shaped3b, shaped7b (Qwen2.5-VL-3B/7B cost ratios), small or tiny",
    )
    ap.add_argument(
        "--rates",
        default=None,
        help="comma-separated requests/s ('inf': all at once); default: 0.5, "
        "0.8, 1 and 1.25 x the slower side's profiled capacity, then all at once",
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per point (default 48; --quick 8)")
    ap.add_argument("--runs", type=int, default=None, help="runs per point (default 3; --quick 1)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profile (no predictions, no efficiency)")
    ap.add_argument(
        "--profile-from",
        type=Path,
        default=None,
        help="use this profile (same model, mix and shares) instead of profiling",
    )
    ap.add_argument("--tag", default="", help="suffix of the result files (epd_vs_colocated<tag>.json/.png)")
    ap.add_argument("--family", default="qwen2_5_vl", help="the offline checkpoints' family (shaped: qwen2_5_vl)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.prompts = args.prompts or (8 if args.quick else 48)
    args.runs = args.runs or (1 if args.quick else 3)
    if args.quick and args.rates is None:
        args.rates = "0.5,inf"
    args.rate_list = [float(r) for r in (args.rates or "0.5,inf").split(",")]
    RESULTS.mkdir(exist_ok=True)
    start = time.perf_counter()
    logs = RESULTS / f"epd_vs_colocated{args.tag}_logs"  # server logs and vllm bench results, kept for inspection
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    results: dict = {
        "slo_ms": SLO,
        "output_tokens": OUTPUT_TOKENS,
        "prompts_per_point": args.prompts,
        "runs": args.runs,
        "cpu_cores": os.cpu_count(),
        "dtype": "float32 (Eric and vLLM)",
        "layout": {
            "colocated": "vllm serve on every core",
            "epd": "Eric + gateway on one half of the cores, vLLM behind Eric on the other",
        },
        "series": {},
    }
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        catalogue = make_series(args.quick, Path(tmp), args.prompts, args.size)
        for name in args.series.split(","):
            results["series"][name] = run_series(catalogue[name], args, logs)
            (RESULTS / f"epd_vs_colocated{args.tag}.json").write_text(json.dumps(results, indent=1))
    results["wall_s"] = time.perf_counter() - start
    (RESULTS / f"epd_vs_colocated{args.tag}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"epd_vs_colocated{args.tag}.png")
    print_table(results)


if __name__ == "__main__":
    main()
