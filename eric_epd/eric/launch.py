"""Starts one Eric server on the shared skeleton: its embedding pool and transfer backends, engine and router."""

from __future__ import annotations

from eric_epd.eric.app import create_app
from eric_epd.eric.config import EricConfig
from eric_epd.eric.workload import encoder_workload
from eric_epd.runtime.launch import run_server
from eric_epd.transfer.producer import TransferHub


def serve(config: EricConfig) -> None:
    """Run until interrupted; a checkpoint Eric cannot serve (or --tp > 1 on the generic path) stops it at once."""
    try:
        workload = encoder_workload(config)
    except ValueError as e:
        raise SystemExit(f"eric-epd serve: --model {config.model}: {e}") from None
    run_server("Eric", config, workload, lambda: TransferHub(config),
               lambda is_alive, hub: create_app(config, is_alive, hub), config.drain_timeout_s)
