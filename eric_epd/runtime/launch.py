"""Starts one server on the skeleton: its output pool, the engine process (which spawns the workers), then the
router in this process; on the way out the engine, the pool and the ipc directory go too."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable
from typing import Protocol, TypeVar

import uvicorn

from eric_epd.common.cpus import pin_process
from eric_epd.common.heap import keep_freed_heap
from eric_epd.common.proxies import uvicorn_proxy_settings
from eric_epd.common.shm_orphans import sweep_orphans
from eric_epd.runtime import run_dir
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.engine.process import EngineProcess
from eric_epd.runtime.executor.shm_broadcast import BROADCAST_PREFIX
from eric_epd.runtime.workload import Workload

logger = logging.getLogger(__name__)


class _LeaveFirstServer(uvicorn.Server):
    """uvicorn's server, except that on the way out it first awaits the app's `before_drain` hook (set on
    `app.state` by its lifespan): an Eric leaves its gateways before it stops accepting connections, so no gateway
    sends it work it would refuse. A second SIGINT (uvicorn's force exit) cuts the hook short."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        hook = getattr(getattr(self.config.app, "state", None), "before_drain", None)
        if hook is not None:
            drain = asyncio.ensure_future(hook())
            while not drain.done() and not self.force_exit:
                await asyncio.wait({drain}, timeout=0.1)
            if not drain.done():
                logger.warning("interrupted again: the drain is cut short")
                drain.cancel()
            for outcome in await asyncio.gather(drain, return_exceptions=True):
                if isinstance(outcome, Exception):  # leaving is best effort; the shutdown goes on regardless
                    logger.error("before-drain hook failed: %r", outcome)
        await super().shutdown(sockets)


class Closable(Protocol):
    """What `run_server` closes when the server stops (the output pool)."""

    def close(self) -> None:
        """Release what the server holds (the output pool)."""


P = TypeVar("P", bound=Closable)


def run_server(
    name: str,
    config: RuntimeConfig,
    workload: Workload,
    make_pool: Callable[[], P],
    make_app: Callable[[EngineProcess, P], object],
    drain_timeout_s: float = 5.0,
) -> None:
    """Run until interrupted; the router's shutdown stops the engine, the engine stops its workers. The pool is
    made before the engine: the workers attach to it. On SIGINT/SIGTERM the app's `before_drain` hook runs first
    while the server still listens (Eric's drain: new encodes refused, its leases still read and acked), then new
    connections are refused and requests in flight get `drain_timeout_s` to finish."""
    if config.resolved_device() == "cuda":
        import torch

        try:
            config.rank_device(config.tp_size - 1, torch.cuda.device_count())  # more ranks than devices: fail now
        except ValueError as e:
            raise SystemExit(f"eric-epd {name}: {e}") from None
    keep_freed_heap(config.heap_keep_bytes)  # the engine and the workers set their own at their start
    if config.cpus:
        pin_process(config.cpus)  # the engine and workers inherit it; each worker narrows it to its slice
    owner = run_dir.claim(config.run_dir)
    sweep_orphans((f"{config.POOL_PREFIX}-", BROADCAST_PREFIX))  # what servers killed outright left on this host
    run_dir.sweep()
    pool = make_pool()
    try:
        engine = EngineProcess.spawn(config, workload)
    except BaseException:
        pool.close()
        raise
    try:
        app = make_app(engine, pool)
        logger.info(
            "%s serving %s (tp=%d) on http://%s:%d", name, config.model, config.tp_size, config.host, config.port
        )
        server = _LeaveFirstServer(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_level="warning",
                timeout_graceful_shutdown=drain_timeout_s,
                **uvicorn_proxy_settings(config.trusted_proxies),
            )
        )
        # uvicorn re-raises the signal it drained on once stopped, under the handler it found: SIGTERM then
        # interrupts like SIGINT, so the engine, the pool and the ipc directory go below instead of the process
        # dying on the spot with them left behind
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            raise SystemExit(f"eric-epd {name}: could not serve on {config.host}:{config.port}")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the cleanup is not cut short (SIGKILL still is)
            signal.signal(sig, signal.SIG_IGN)
        engine.shutdown()
        pool.close()
        shutil.rmtree(config.run_dir, ignore_errors=True)
        os.close(owner)
