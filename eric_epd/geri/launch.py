"""Starts one Geri server: the image pool, the engine process (which spawns the workers), then the router."""

from __future__ import annotations

import logging
import shutil

import uvicorn

from eric_epd.common.cpus import pin_process
from eric_epd.engine.process import EngineProcess
from eric_epd.geri.app import create_app
from eric_epd.geri.config import GeriConfig
from eric_epd.geri.workload import GeneratorWorkload
from eric_epd.transfer.pool import EmbeddingPool

logger = logging.getLogger(__name__)


def serve(config: GeriConfig) -> None:
    """Run until interrupted; the router's shutdown stops the engine, the engine stops its workers."""
    workload = GeneratorWorkload.from_checkpoint(config.model, config.limits)
    if config.cpus:
        pin_process(config.cpus)  # the engine and workers inherit it; each worker narrows it to its slice
    config.run_dir.mkdir(parents=True, exist_ok=True)
    pool = EmbeddingPool(config.pool_name, config.pool_bytes, ttl_s=config.request_timeout_s)
    try:
        engine = EngineProcess.spawn(config, workload)
    except BaseException:
        pool.close()
        raise
    try:
        app = create_app(config, engine.is_alive, pool, workload)
        logger.info("Geri serving %s (tp=%d) on http://%s:%d", config.model, config.tp_size, config.host, config.port)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        pool.close()
        shutil.rmtree(config.run_dir, ignore_errors=True)
