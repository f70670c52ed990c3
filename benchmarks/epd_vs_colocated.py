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
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from epd_report import pipeline_efficiency, plot, prediction_errors, print_table, ratios  # sibling scripts
from epd_series import OUTPUT_TOKENS, SLO, Series, make_series, traffic_of  # (benchmarks/ is on sys.path)
from epd_sides import run_side
from multiturn import print_turns

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus
from eric_epd.planning.planner import Layout
from eric_epd.planning.predictions import read_predictions
from eric_epd.planning.profiler import ProfileConfig, profile
from eric_epd.planning.profiles import Profile, Traffic, read_profile
from eric_epd.planning.simulate import EngineModel, tokens_per_item
from eric_epd.stack.servers import LocalServers, host_split

RESULTS = Path(__file__).parent / "results"
PREDICTIONS = RESULTS / "predictions"
"""The planner's predictions and the profile they came from, per tag and series: written by --predict-only and
committed before the run that measures them (--predictions-first reads them)."""


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


def predict_first(prof_path: Path, traffic: Traffic, rates: list[float], prompts: int, out: Path) -> None:
    """`eric-epd plan --rates` on the profile: both sides' predictions at every rate, written to `out` (committed
    before the runs; tests/project/test_predictions_first.py recomputes the comparison from the committed files)."""
    cmd = [
        sys.executable,
        "-m",
        "eric_epd",
        "plan",
        "--profile",
        str(prof_path),
        "--devices",
        str(len(available_cpus())),
    ]
    cmd += ["--ttft-ms", str(SLO["ttft"]), "--tpot-ms", str(SLO["tpot"]), "--requests", str(prompts), "--seeds", "10"]
    cmd += ["--images", str(traffic.images_per_request), "--sides", ",".join(map(str, traffic.sides))]
    cmd += ["--prompt-tokens", str(traffic.prompt_tokens), "--output-tokens", str(traffic.output_tokens)]
    cmd += ["--rates", ",".join(map(str, rates)), "--predictions", str(out)]
    subprocess.run(cmd, check=True)
    eric_cpus, engine_cpus = host_split()
    want = {"epd": Layout(1, len(eric_cpus), 1, len(engine_cpus)), "colocated": Layout(0, 0, 1, len(available_cpus()))}
    got = {
        side: msgspec.structs.replace(lay, max_batched_tokens=0) for side, lay in read_predictions(out).layouts.items()
    }
    if got != want:
        raise SystemExit(f"the plan's layouts {got} are not the benchmark's {want}")


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
    predicted: dict = {}
    if "--random-mm-bucket-config" in series.dataset and not args.no_profile:
        first = PREDICTIONS / f"epd_vs_colocated{args.tag}_{series.name}.json"
        prof_path = first.with_name(first.stem + "_profile.json")
        if args.predict_only:
            prof_path.parent.mkdir(parents=True, exist_ok=True)
            prof = profile_shares(model, traffic_of(series), logs / series.name, args.prompts)
            shutil.copyfile(logs / series.name / "profile.json", prof_path)
            if args.rates is None:  # up to saturation: fractions of the slower side's capacity alone, then all at once
                top = min(capacity_alone(prof, traffic_of(series)).values())
                rates = [round(top * f, 3) for f in (0.5, 0.8, 1.0, 1.25)] + [float("inf")]
            predict_first(prof_path, traffic_of(series), rates, args.prompts, first)
            return {"predictions": str(first.relative_to(RESULTS.parent.parent))}
        if not first.exists():
            raise SystemExit(f"{first} is missing: run with --predict-only first and commit what it writes")
        prof, ahead = read_profile(prof_path), read_predictions(first)
        rates = [float(r) for r in ahead.points["epd"]]
        predicted = msgspec.to_builtins(ahead.points)
        out.update(predictions_file=str(first.relative_to(RESULTS.parent.parent)), predictions_made_at=ahead.made_at)
        out["profile"] = msgspec.to_builtins(prof)
        out["cost_check"] = cost_check(prof)
        out["capacity_alone"] = capacity_alone(prof, traffic_of(series))
    elif args.predict_only:
        return {}
    for side in ("colocated", "epd"):
        started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        out[side] = {"started_at": started_at, **run_side(side, series, model, rates, args, logs)}
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
        "--predict-only",
        action="store_true",
        help="profile the random-mm series and write `eric-epd plan`'s predictions of every rate to "
        "benchmarks/results/predictions/ (commit them), then stop; a run without it measures those rates and "
        "compares with those predictions",
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
            if not args.predict_only:
                (RESULTS / f"epd_vs_colocated{args.tag}.json").write_text(json.dumps(results, indent=1))
    if args.predict_only:
        print(json.dumps(results["series"], indent=1))
        return
    results["wall_s"] = time.perf_counter() - start
    (RESULTS / f"epd_vs_colocated{args.tag}.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"epd_vs_colocated{args.tag}.png")
    print_table(results)


if __name__ == "__main__":
    main()
