"""Command line: `eric-epd serve` runs an Eric encode server; `eric-epd geri` a Geri generation server; `eric-epd up`
the whole local EPD stack; `eric-epd profile` and `plan` measure a model's two sides and size the split;
`eric-epd build-checkpoint` writes a tiny model."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from eric_epd.checkpoints.builtin import SIZES
from eric_epd.eric import cli as eric_cli
from eric_epd.geri import cli as geri_cli
from eric_epd.planning import cli as planning_cli


def _slo(text: str) -> tuple[float, float]:
    """'TTFT,TPOT' in ms: two positive numbers."""
    parts = text.split(",")
    try:
        ttft, tpot = (float(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TTFT,TPOT in ms (e.g. 8000,400), got {text!r}") from None
    if ttft <= 0 or tpot <= 0:
        raise argparse.ArgumentTypeError(f"TTFT and TPOT must be positive, got {text!r}")
    return ttft, tpot


def _up_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="the whole local EPD stack (Eric, vLLM behind Eric, the gateway) on disjoint CPUs")
    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the built-in tiny Qwen2-VL)"
    )
    p.add_argument("--port", type=int, default=8000, help="the gateway's port")
    p.add_argument("--tp", type=int, default=1, help="Eric's tensor-parallel size")
    p.add_argument(
        "--api-key",
        default=None,
        help="clients' key for the gateway (default: $EPD_GATEWAY_API_KEY); the /metrics key is "
        "$EPD_GATEWAY_METRICS_KEY, else generated into LOG_DIR/metrics.key",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temporary directory)")
    p.add_argument("--ready-file", type=Path, default=None, help="write the gateway URL here once serving")
    p.add_argument(
        "--eric-cpus",
        type=int,
        default=0,
        help="CPUs for Eric and the gateway, the engine gets the rest (default: half, or --plan-from)",
    )
    p.add_argument(
        "--plan-from",
        type=Path,
        default=None,
        help="a profile from `eric-epd profile`: size Eric's CPUs by `eric-epd plan`'s best split",
    )
    p.add_argument(
        "--slo", type=_slo, default=(8000.0, 400.0), help="TTFT,TPOT in ms that --plan-from optimizes goodput for"
    )


def build_parser() -> argparse.ArgumentParser:
    """The `eric-epd` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="eric-epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    eric_cli.add_parser(sub)
    b = sub.add_parser("build-checkpoint", help="write a random tiny/small checkpoint of a registered family")
    b.add_argument("out", type=Path, help="directory to write the checkpoint to")
    b.add_argument(
        "--family",
        default="qwen2_vl",
        help="qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe or qwen3_5 (checked by the builder)",
    )
    b.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help="tiny: for tests; small: for benchmarks; shaped3b/shaped7b (qwen2_5_vl): cost ratios of the "
        "released 3B and 7B",
    )
    b.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    _up_parser(sub)
    geri_cli.add_parser(sub)
    planning_cli.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` and run the chosen subcommand: serve, geri, up, profile, plan or build-checkpoint."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        from eric_epd.eric.launch import serve

        serve(eric_cli.config_from_args(args))
    elif args.command == "geri":
        from eric_epd.geri.launch import serve as serve_geri

        serve_geri(geri_cli.config_from_args(args))
    elif args.command == "up":
        from eric_epd.stack.up import UpConfig, up

        raise SystemExit(
            up(
                UpConfig(
                    model=eric_cli.model_or_default(args.model),
                    port=args.port,
                    tp=args.tp,
                    api_key=args.api_key or os.environ.get("EPD_GATEWAY_API_KEY") or None,
                    log_dir=args.log_dir,
                    ready_file=args.ready_file,
                    eric_cpus=args.eric_cpus,
                    plan_from=args.plan_from,
                    slo=args.slo,
                    metrics_key=os.environ.get("EPD_GATEWAY_METRICS_KEY") or None,
                )
            )
        )
    elif args.command == "profile":
        from eric_epd.stack.servers import LocalServers

        planning_cli.run_profile(args, LocalServers())
    elif args.command == "plan":
        print(planning_cli.run_plan(args))
    else:
        from eric_epd.checkpoints.builtin import build_checkpoint

        print(build_checkpoint(args.out, args.family, args.size, args.seed))
