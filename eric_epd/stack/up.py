"""`eric-epd up`: the whole local EPD stack on one host (Eric, vLLM behind Eric, the gateway), on disjoint CPUs,
with every key generated and wired; serves until Ctrl-C or SIGTERM, then stops every process it started."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from eric_epd.common.cpus import available_cpus, format_cpus
from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe, host_split

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpConfig:
    """What `eric-epd up` starts."""

    model: Path
    port: int = 8000
    tp: int = 1
    api_key: str | None = None
    """The clients' key for the gateway (none: open, as on a laptop)."""
    log_dir: Path | None = None
    keep_acked_bytes: int = 128 << 20
    """Eric keeps this many bytes of acknowledged embeddings as a content cache, so a repeated image is not encoded
    again (a quarter of Eric's default 512 MiB pool)."""
    ready_file: Path | None = None
    """Written with the gateway URL once every server is healthy (for scripts that start `up` in the background)."""
    eric_cpus: int = 0
    """CPUs for Eric and the gateway (the engine gets the rest); 0: half the host, or what `plan_from` says."""
    plan_from: Path | None = None
    """A profile (`eric-epd profile`): Eric's CPU count is the planner's best split for `slo` on the profiled mix."""
    slo: tuple[float, float] = (8000.0, 400.0)
    """(TTFT, TPOT) in ms the plan optimizes goodput for."""
    metrics_key: str | None = None
    """The key a scraper sends for the gateway's /metrics; none: generated and written to `metrics.key` (mode 0600)
    in the log directory."""


def split_for(config: UpConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Eric's CPUs, the engine's CPUs): a count given, or planned from a profile, or the host's two halves."""
    cpus = available_cpus()
    count = config.eric_cpus
    if not count and config.plan_from is not None:
        from eric_epd.planning.planner import eric_share_for_host
        from eric_epd.planning.profiles import Slo, read_profile

        profile = read_profile(config.plan_from)
        count = eric_share_for_host(profile, len(cpus), profile.traffic, Slo(*config.slo))
        logger.info("planned from %s: Eric on %d of %d CPUs", config.plan_from, count, len(cpus))
    if not count:
        return host_split()
    if not 0 < count < len(cpus):
        raise ValueError(f"Eric needs between 1 and {len(cpus) - 1} of this host's {len(cpus)} CPUs, not {count}")
    return cpus[:count], cpus[count:]


def _write_secret(path: Path, secret: str) -> None:
    """`secret` in a file only its owner may read (created so, never world-readable for an instant)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    logger.info("the gateway's /metrics key is in %s", path)


def _watch(servers: list[ServerProcess], stop: threading.Event) -> str | None:
    """Wait until `stop` is set or a server exits; the name of the one that exited, else None."""
    while not stop.wait(0.5):
        for server in servers:
            if server.proc is not None and server.proc.poll() is not None:
                return f"{server._cmd[2:4]} exited with code {server.proc.returncode}"
    return None


def up(config: UpConfig) -> int:
    """Start the stack, serve until stopped (signal) or until a server dies; 0 on a clean stop."""
    logs = config.log_dir or Path(tempfile.mkdtemp(prefix="eric-epd-up-"))
    logs.mkdir(parents=True, exist_ok=True)
    eric_cpus, engine_cpus = split_for(config)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ExitStack() as stack:
            logger.info(
                "Eric on CPUs %s, vLLM on CPUs %s; logs in %s", format_cpus(eric_cpus), format_cpus(engine_cpus), logs
            )
            eric = stack.enter_context(
                EricServer(
                    config.model,
                    tp=config.tp,
                    cpus=eric_cpus,
                    extra_args=("--keep-acked-bytes", str(config.keep_acked_bytes)),
                    log_path=logs / "eric.log",
                )
            )
            vllm = stack.enter_context(
                VllmServe(
                    config.model, logs / "vllm.log", eric_urls=[eric.url], eric_api_key=eric.api_key, cpus=engine_cpus
                )
            )
            gateway = stack.enter_context(
                GatewayServer(
                    logs / "gateway.log",
                    "--encoder-urls",
                    eric.url,
                    "--colocated-urls",
                    vllm.url,
                    eric_api_key=eric.api_key,
                    upstream_api_key=vllm.api_key,
                    api_key=config.api_key,
                    port=config.port,
                    cpus=eric_cpus,
                    metrics_key=config.metrics_key,
                )
            )
            if config.metrics_key is None:
                _write_secret(logs / "metrics.key", gateway.metrics_key)
            logger.info("EPD stack serving: %s/v1 (gateway) -> Eric %s -> vLLM %s", gateway.url, eric.url, vllm.url)
            if config.ready_file is not None:
                config.ready_file.write_text(gateway.url)
            died = _watch([eric, vllm, gateway], stop)
            if died is not None:
                logger.error("stopping the stack: %s (logs in %s)", died, logs)
                return 1
            logger.info("stopping the stack")
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
