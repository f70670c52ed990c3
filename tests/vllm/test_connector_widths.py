"""The connector checks each Eric item's row width against its modality's (Qwen3-Omni: DeepStack image and video rows
[main | level 1 | level 2] three times the text width, audio rows the text width): a handle of a width the model has
for no modality is refused with the request's handles, and one of another modality's width fails its request before
anything is fetched."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from vllm.config import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from eric_epd.plugins.vllm.connector import EricECConnector
from eric_epd.plugins.vllm.landing import LandingAddress
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import handles_xargs

HIDDEN = 16
ERIC = "http://127.0.0.1:9"
OMNI = {
    "model_type": "qwen3_omni_moe",
    "thinker_config": {
        "text_config": {"hidden_size": HIDDEN},
        "vision_config": {"out_hidden_size": HIDDEN, "deepstack_visual_indexes": [1, 2]},
    },
}


@pytest.fixture
def connector() -> Iterator[EricECConnector]:
    """The connector's scheduler side as vLLM builds it for a Qwen3-Omni thinker (nothing is fetched here)."""
    extra = {"eric_urls": [ERIC], "backends": ["http"], "fetch_timeout_s": 0.5, "staging_bytes": 1 << 20}
    address = LandingAddress(f"widths{uuid.uuid4().hex[:8]}")
    config = SimpleNamespace(
        ec_transfer_config=ECTransferConfig(
            ec_connector="EricECConnector", ec_role="ec_consumer", ec_connector_extra_config=extra
        ),
        parallel_config=SimpleNamespace(data_parallel_index=address.dp_index, tensor_parallel_size=1),
        instance_id=address.instance,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: OMNI)),
    )
    built = EricECConnector(config, ECConnectorRole.SCHEDULER)  # type: ignore[arg-type]
    try:
        yield built
    finally:
        built.shutdown()


def _request(rid: str, modality: str, rows: int, width: int) -> Request:
    """An EPD request with one metadata-only `modality` item and a handle of [rows, width] float32 rows."""
    key = uuid.uuid4().hex * 2
    handle = EmbeddingHandle(
        key, (rows, width), "float32", rows * width * 4, ERIC, "i0", f"{ERIC}/v1/embeddings/{key}", lease="lease"
    )
    feature = MultiModalFeatureSpec(
        data=None, modality=modality, identifier=key, mm_position=PlaceholderRange(offset=1, length=rows)
    )
    return Request(
        rid, [0] * (rows + 2), SamplingParams(extra_args=handles_xargs([handle])), None, mm_features=[feature]
    )


def test_widths_by_modality(connector: EricECConnector) -> None:
    assert connector.scheduler._widths == {"image": 3 * HIDDEN, "video": 3 * HIDDEN, "audio": HIDDEN}


@pytest.mark.parametrize(("modality", "width"), [("audio", 3 * HIDDEN), ("image", HIDDEN), ("video", HIDDEN)])
def test_another_modalitys_width_fails_the_request(connector: EricECConnector, modality: str, width: int) -> None:
    request = _request("r1", modality, 4, width)
    assert connector.scheduler._offers_of(request)  # a width the model has: the handle passes the common checks
    assert not connector.ensure_cache_available(request, 0)
    assert connector.take_unavailable_requests() == {"r1"}
    assert connector.scheduler._prefetch.get(request.mm_features[0].identifier) is None  # nothing was fetched


def test_a_width_of_no_modality_is_refused(connector: EricECConnector) -> None:
    request = _request("r2", "image", 4, 2 * HIDDEN)
    assert connector.scheduler._offers_of(request) == {}
    assert connector.take_unavailable_requests() == {"r2"}
