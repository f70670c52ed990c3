"""Command-line flags every server on the shared skeleton takes (tensor parallelism, dtype, device, listen address)."""

from __future__ import annotations

import argparse

from eric_epd.common.heap import DEFAULT_KEEP_BYTES
from eric_epd.runtime.config import DTYPES


def add_server_flags(p: argparse.ArgumentParser, *, what: str, dtype_help: str, port: int) -> None:
    """--tp, --dtype, --device, --host and --port; `what` names the model in help texts ("encoder", "generator")."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one worker process per rank)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help=dtype_help)
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help=f"where the {what} runs (auto: CUDA if present, else CPU)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (loopback by default; a private interface in a cluster, never all)",
    )
    p.add_argument("--port", type=int, default=port, help="HTTP port")
    p.add_argument(
        "--liveness-timeout",
        type=float,
        default=30.0,
        help="seconds the engine's heartbeat may be silent before /health answers 503 (a batch in flight "
        "renews it: a long batch is busy, not dead)",
    )
    p.add_argument(
        "--heap-keep-bytes",
        type=int,
        default=DEFAULT_KEEP_BYTES,
        help="freed memory each malloc arena of the server's processes keeps for reuse (at least 1 MiB), so bodies of "
        "megabytes do not fault fresh pages in each time (glibc's mallopt; 0: the allocator's own defaults)",
    )
