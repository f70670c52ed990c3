"""vLLM plugin: registered through the `vllm.general_plugins` entry point in every vLLM process."""

from __future__ import annotations

CONNECTOR_NAME = "EricECConnector"


def register() -> None:
    """Make `--ec-transfer-config '{"ec_connector": "EricECConnector", ...}'` resolve to our connector, and vLLM's
    audio resampling bounded and working without torchaudio (resample.py)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from eric_epd.plugins.vllm.resample import install

    install()

    if CONNECTOR_NAME not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, "eric_epd.plugins.vllm.connector", CONNECTOR_NAME)
