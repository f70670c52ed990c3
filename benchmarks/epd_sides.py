"""One side (colocated vLLM or EPD) of a benchmarks/epd_vs_colocated.py series: its servers started on their
cores, `vllm bench serve` at each rate (or the series' own driver), and the servers' stage means."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
from epd_report import KEYS, summarize  # sibling scripts (benchmarks/ is on sys.path)
from epd_series import SLO, Series

from eric_epd.common.cpus import available_cpus
from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe, host_split
from eric_epd.stack.up import UpConfig

logger = logging.getLogger("epd_vs_colocated")
MAX_MODEL_LEN = 8192  # the offline checkpoints' max_position_embeddings


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
