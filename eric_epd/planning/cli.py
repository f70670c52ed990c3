"""`eric-epd profile` and `eric-epd plan`: their flags, parsed once into a ProfileConfig or a PlanConfig."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import msgspec

from eric_epd.common.cpus import parse_cpus
from eric_epd.planning.profiles import Slo, Traffic
from eric_epd.planning.servers import Servers

logger = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _rates(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _traffic_flags(p: argparse.ArgumentParser, rate: bool) -> None:
    default = Traffic()
    p.add_argument("--images", type=int, default=default.images_per_request, help="images per request")
    p.add_argument(
        "--sides",
        type=_ints,
        default=default.sides,
        help="image sides in px, comma-separated (square images, each side equally likely)",
    )
    p.add_argument("--prompt-tokens", type=int, default=default.prompt_tokens, help="text tokens per prompt")
    p.add_argument("--output-tokens", type=int, default=default.output_tokens, help="output tokens per request")
    if rate:
        p.add_argument("--rate", type=float, default=0.0, help="requests/s, Poisson (0: all at once)")


def _traffic(args: argparse.Namespace) -> Traffic:
    return Traffic(args.images, tuple(args.sides), args.prompt_tokens, args.output_tokens, getattr(args, "rate", 0.0))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The `profile` and `plan` subcommands."""
    p = sub.add_parser(
        "profile",
        help="measure Eric's and the engine's throughput-latency frontiers on given "
        "devices; write a JSON profile for `eric-epd plan`",
    )
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (a Qwen2-VL / Qwen2.5-VL family)")
    p.add_argument("--out", type=Path, required=True, help="the profile JSON to write")
    p.add_argument(
        "--share",
        type=parse_cpus,
        action="append",
        required=True,
        help="a device share to profile: CPU cores (e.g. 0 or 0-1), or GPU ids with --device cuda; "
        "repeat for each share size the plan may use",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="what the share ids name")
    p.add_argument("--dtype", default="float32", help="both sides' dtype (float32, bfloat16, float16)")
    p.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8), help="Eric's client concurrencies")
    p.add_argument("--batches", type=_ints, default=(1, 2, 4, 8, 16), help="engine decode batch sizes")
    p.add_argument("--requests", type=int, default=8, help="Eric requests per concurrency point (at least 2 x it)")
    p.add_argument(
        "--saturation-requests",
        type=int,
        default=16,
        help="requests of the mix sent to the engine at once to measure its capacity alone",
    )
    p.add_argument("--max-model-len", type=int, default=8192, help="the engine's --max-model-len")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temporary directory)")
    _traffic_flags(p, rate=False)
    q = sub.add_parser(
        "plan",
        help="the Eric/engine split for a traffic mix and SLO, with predicted latency, "
        "throughput and goodput for EPD and colocated serving",
    )
    q.add_argument("--profile", type=Path, required=True, help="a profile JSON from `eric-epd profile`")
    q.add_argument("--devices", type=int, default=0, help="devices in all (default: the largest profiled share)")
    q.add_argument("--ttft-ms", type=float, required=True, help="SLO: time to first token, ms")
    q.add_argument("--tpot-ms", type=float, required=True, help="SLO: time per output token, ms")
    q.add_argument("--requests", type=int, default=200, help="simulated requests per seed")
    q.add_argument("--seeds", type=int, default=5, help="simulated runs (medians are reported)")
    q.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="the engines' token budget per step (vLLM's --max-num-batched-tokens; its CPU server default is 2048)",
    )
    q.add_argument("--max-seqs", type=int, default=16, help="the engines' --max-num-seqs")
    q.add_argument(
        "--try-batched-tokens",
        type=_ints,
        default=(),
        help="further token budgets per step to try for both modes, comma-separated (e.g. 512,128)",
    )
    q.add_argument("--json", type=Path, default=None, help="also write the plan here")
    q.add_argument(
        "--rates",
        type=_rates,
        default=(),
        help="comma-separated arrival rates in requests/s ('inf': all at once): predict the plan's EPD layout and "
        "colocated serving at each, written to --predictions (before a benchmark measures them)",
    )
    q.add_argument("--predictions", type=Path, default=None, help="where --rates' predictions go (JSON)")
    _traffic_flags(q, rate=True)


def run_profile(args: argparse.Namespace, servers: Servers) -> None:
    """`eric-epd profile`, its servers started by `servers` (the caller's: eric_epd/cli.py passes the stack's)."""
    from eric_epd.planning.profiler import ProfileConfig, profile

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    profile(
        ProfileConfig(
            model=args.model,
            out=args.out,
            shares=tuple(args.share),
            traffic=_traffic(args),
            device=args.device,
            dtype=args.dtype,
            concurrencies=args.concurrency,
            batches=args.batches,
            requests_per_point=args.requests,
            max_model_len=args.max_model_len,
            saturation_requests=args.saturation_requests,
            log_dir=args.log_dir,
        ),
        servers,
    )


def run_plan(args: argparse.Namespace) -> str:
    """`eric-epd plan`: the plan's table, then Eric's host and tower cost per item on each profiled share (and JSON
    where asked)."""
    from eric_epd.planning.planner import PlanConfig, plan, render_host_split, render_plan
    from eric_epd.planning.profiles import read_profile

    if bool(args.rates) != (args.predictions is not None):
        raise SystemExit("eric-epd plan: --rates and --predictions go together")
    prof = read_profile(args.profile)
    devices = args.devices or max(len(s.devices) for s in prof.shares)
    config = PlanConfig(
        devices,
        _traffic(args),
        Slo(args.ttft_ms, args.tpot_ms),
        args.requests,
        args.seeds,
        args.max_batched_tokens,
        args.max_seqs,
        args.try_batched_tokens,
    )
    result = plan(prof, config)
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=1))
    if args.predictions is not None:
        from eric_epd.planning.predictions import predict_rates, write_predictions

        write_predictions(
            args.predictions, predict_rates(prof, args.profile.read_bytes(), result, config, tuple(args.rates))
        )
    return render_plan(result) + "\n" + render_host_split(prof)
