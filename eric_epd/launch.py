"""Starts one Eric server: the engine process (which spawns the workers), then the router in this process."""

from __future__ import annotations

import logging
import shutil

import uvicorn

from eric_epd.common.cpus import pin_process
from eric_epd.config import EricConfig
from eric_epd.engine.process import EngineProcess
from eric_epd.models.workload import EncoderWorkload
from eric_epd.server.app import create_app
from eric_epd.transfer.producer import TransferHub

logger = logging.getLogger(__name__)


def serve(config: EricConfig) -> None:
    """Run until interrupted; the router's shutdown stops the engine, the engine stops its workers."""
    if config.resolved_device() == "cuda":
        import torch

        try:
            config.rank_device(config.tp_size - 1, torch.cuda.device_count())  # more ranks than devices: fail now
        except ValueError as e:
            raise SystemExit(f"eric-epd serve: {e}") from None
    if config.cpus:
        pin_process(config.cpus)  # the engine and workers inherit it; each worker narrows it to its slice
    config.run_dir.mkdir(parents=True, exist_ok=True)
    hub = TransferHub(config)  # the pool must exist before workers attach to it
    try:
        engine = EngineProcess.spawn(config, EncoderWorkload.from_checkpoint(config.model))
    except BaseException:
        hub.close()
        raise
    try:
        app = create_app(config, engine.is_alive, hub)
        logger.info("Eric serving %s (tp=%d) on http://%s:%d", config.model, config.tp_size, config.host, config.port)
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
        hub.close()
        shutil.rmtree(config.run_dir, ignore_errors=True)
