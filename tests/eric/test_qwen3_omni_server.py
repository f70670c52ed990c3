"""A real Eric (router, engine, worker) on the tiny Qwen3-Omni-MoE checkpoint: one request carrying audio clips (odd
lengths, rates and channel counts, each at least a second), an image and a video is answered with rows of each
modality's own width (DeepStack image and video rows three times the text width, audio rows the text width),
fetched over the transfer path with each item's lease, equal to transformers' thinker's on the samples vLLM's loader
gives (zero-padded to whole hops, as vLLM feeds the model), the decoded image and the frames Eric samples."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eric_epd.stack.servers import EricServer
from tests.support.helpers_servers import encode_items
from tests.support.omni_reference import qwen3_omni_rows
from tests.support.omni_request import assert_answered_with, references, request_items

WIDTHS = {"audio": 64, "image": 192, "video": 192}


@pytest.fixture(scope="module")
def eric(qwen3_omni_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    root = tmp_path_factory.mktemp("qwen3-omni")
    with EricServer(
        qwen3_omni_tiny, log_path=root / "eric.log", extra_args=("--dtype", "float32", "--max-audio-channels", "2")
    ) as server:
        yield server


def test_items_are_answered_with_transformers_rows_at_their_modalitys_width(
    eric: EricServer, qwen3_omni_tiny: Path
) -> None:
    card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
    assert card["modalities"] == ["image", "video", "audio"] and card["placement"] == "media"
    resp = encode_items(eric, request_items())
    assert resp.status_code == 200, resp.text
    assert_answered_with(eric, resp.json()["items"], references(qwen3_omni_tiny, qwen3_omni_rows), WIDTHS)
