"""Starts one Eric server: the engine process (which spawns the workers), then the router in this process."""

from __future__ import annotations

import logging
import shutil

import uvicorn

from eric_epd.config import EricConfig
from eric_epd.engine.process import EngineProcess
from eric_epd.server.app import create_app

logger = logging.getLogger(__name__)


def serve(config: EricConfig) -> None:
    """Run until interrupted; the router's shutdown stops the engine, the engine stops its workers."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    engine = EngineProcess.spawn(config)
    try:
        app = create_app(config, engine.is_alive)
        logger.info("Eric serving %s (tp=%d) on http://%s:%d", config.model, config.tp_size, config.host, config.port)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        shutil.rmtree(config.run_dir, ignore_errors=True)
