"""Engine and EncodeService stand-ins shared by tests that run without processes: an executor that runs batches
instantly, work requests for it, and a fake engine client and media source for EncodeService over a real pool."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from eric_epd.eric.answers import OutputSpec
from eric_epd.eric.config import EricConfig
from eric_epd.eric.launch import transfer_hub
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.processor import PreparedItem
from eric_epd.eric.service import EncodeService
from eric_epd.eric.workload import EncoderWorkload, EncodeSpec
from eric_epd.models.processor import ProcessedItem
from eric_epd.runtime.engine.client import EngineRequest
from eric_epd.runtime.engine.messages import WorkRequestMsg, WorkResultMsg
from eric_epd.runtime.work import Batch, BatchOutput, ItemResult, WorkItem, pack_spec
from eric_epd.transfer.config import TransferConfig
from eric_epd.wire.eric import EncodeItem

# ---------------------------------------------------------------- engine protocol


class InstantExecutor:
    """Runs every batch instantly: each item yields (cost // 4, 8) float32 rows; there are no worker processes."""

    def submit(self, batch: Batch) -> None:
        pass

    def collect(self, batch: Batch) -> BatchOutput:
        return BatchOutput([ItemResult(e.item.key, (e.item.cost // 4, 8), "float32") for e in batch.entries])

    def workers(self) -> list:
        return []

    def check_workers(self) -> str | None:
        return None


WORKLOAD = EncoderWorkload(merge_unit=4, pixel_row=3)


def work_request(request_id: str, hashes: list[str]) -> tuple[WorkRequestMsg, list[memoryview]]:
    """A request of one 4-patch image per hash, with its (zero) inputs."""
    items = [WorkItem(h, "image", 4, 0, 128, pack_spec(EncodeSpec("image", (1, 2, 2), 3))) for h in hashes]
    return WorkRequestMsg(request_id, items), [memoryview(np.zeros((4, 3), np.float32)) for _ in hashes]


# ---------------------------------------------------------------- EncodeService (fake engine)


class FakeEngine:
    """EngineClient stand-in: requests stay in the engine until the test answers them; aborts are recorded."""

    request_timeout_s = 30.0

    def __init__(self) -> None:
        self.requests: list[tuple[EngineRequest, list[WorkItem]]] = []
        self.aborts: list[tuple[str, list[int] | None]] = []

    def submit(self, items: list[WorkItem], inputs: list[np.ndarray]) -> EngineRequest:
        request = EngineRequest(f"r{len(self.requests)}", len(items), asyncio.get_running_loop().create_future())
        self.requests.append((request, list(items)))
        return request

    def abort(self, request: EngineRequest, items: list[int] | None = None) -> None:
        self.aborts.append((request.request_id, None if items is None else sorted(items)))

    def answer(self, number: int, finished: list[int], status: int = 200) -> None:
        """The engine's final answer for request `number`: these item indices were written."""
        request, items = self.requests[number]
        results = [ItemResult(items[i].key, (4, 8), "float32") for i in finished]
        error = None if status == 200 else "request aborted"
        request.result.set_result((WorkResultMsg(request.request_id, results, error, status), []))


class FakeMedia:
    """Fetcher and processor in one: the URL names the content (and so the hash)."""

    async def fetch(self, url: str) -> bytes:
        return url.encode()

    async def prepare_many(self, items: list[tuple[str, bytes]], hop_padded: bool = True) -> list[PreparedItem]:
        return [
            PreparedItem(data.decode(), ProcessedItem(modality, np.zeros((16, 12), np.float32), (1, 4, 4), 4))
            for modality, data in items
        ]


def items(*names: str) -> list[EncodeItem]:
    """One image item per name; the name is its URL (and so its content)."""
    return [EncodeItem(id=n, modality="image", url=n) for n in names]


async def settle() -> None:
    """Let every ready task of the running loop take its next steps."""
    for _ in range(20):
        await asyncio.sleep(0)


@contextmanager
def encode_service(engine: FakeEngine, pool_bytes: int = 1 << 20, max_items: int = 512) -> Iterator[EncodeService]:
    """An EncodeService on `engine` and FakeMedia, over a real pool of `pool_bytes` (rows of 8 float32 values),
    taking up to `max_items` items at a time."""
    config = EricConfig(model=Path("."), transfer=TransferConfig(pool_bytes=pool_bytes, backends=()))
    hub = transfer_hub(config)
    try:
        yield EncodeService(
            FakeMedia(), FakeMedia(), engine, hub, EricMetrics(), OutputSpec(8, "float32"), max_items=max_items
        )
    finally:
        hub.close()
