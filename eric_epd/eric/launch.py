"""Starts one Eric server on the shared skeleton: its embedding pool and transfer backends, engine and router."""

from __future__ import annotations

from eric_epd.eric.app import create_app
from eric_epd.eric.config import EricConfig
from eric_epd.eric.workload import encoder_workload
from eric_epd.models.facts import ModelFacts
from eric_epd.runtime.launch import run_server
from eric_epd.transfer.producer import TransferHub


def transfer_hub(config: EricConfig) -> TransferHub:
    """The embedding pool and producer backends of the Eric `config` describes."""
    return TransferHub(
        config.transfer, pool_name=config.pool_name, instance_id=config.instance_id, public_url=config.public_url
    )


def serve(config: EricConfig) -> None:
    """Run until interrupted. The checkpoint's config.json is read here, once for this process (the engine and
    the workers get the workload built from it; each worker reads it once more to build its encoder); a checkpoint
    Eric cannot serve (or a --tp its tower does not take: > 1 on transformers' classes) stops it at once."""
    try:
        facts = ModelFacts.from_checkpoint(config.model)
        workload = encoder_workload(config, facts, config.compile, config.compute_dtype)
    except ValueError as e:
        raise SystemExit(f"eric-epd serve: --model {config.model}: {e}") from None
    run_server(
        "Eric",
        config,
        workload,
        lambda: transfer_hub(config),
        lambda is_alive, hub: create_app(config, facts, is_alive, hub),
        config.drain_timeout_s,
    )
