"""Starts one Geri server on the shared skeleton: its image pool, engine and router."""

from __future__ import annotations

from eric_epd.geri.app import create_app
from eric_epd.geri.config import GeriConfig
from eric_epd.geri.workload import GeneratorWorkload
from eric_epd.runtime.launch import run_server
from eric_epd.transfer.pool import EmbeddingPool


def serve(config: GeriConfig) -> None:
    """Run until interrupted."""
    workload = GeneratorWorkload.from_checkpoint(config.model, config.limits)
    run_server(
        "Geri",
        config,
        workload,
        lambda: EmbeddingPool(config.pool_name, config.pool_bytes, ttl_s=config.request_timeout_s),
        lambda is_alive, pool: create_app(config, is_alive, pool, workload),
    )
