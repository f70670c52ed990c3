"""Nothing leaked or stuck under faults: a store read whose request went away (or that outlasts its wait) frees its
region and never blocks its hash; an ack whose first answer was lost is told apart from an expired lease; the same
image under two URLs through a real gateway gives every lease back. Pools end at exactly 0 held bytes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from epd_gateway.content import MediaRef, kept_handles, spare_handles, with_embeddings
from safetensors.numpy import load as load_safetensors
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from eric_epd.common.errors import ApiError
from eric_epd.eric.answers import OutputSpec
from eric_epd.eric.config import EricConfig
from eric_epd.eric.launch import transfer_hub
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.service import EncodeService
from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import EricServer, GatewayServer, StoreMaster
from eric_epd.testing.media import data_url, image_data_url, random_image
from eric_epd.testing.pools import assert_pool_empty, wait_pool_drained
from eric_epd.testing.stack import image_messages, metric, wait_for
from eric_epd.testing.standins import EmbedsEngine, _ThreadServer
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.transfer.config import TransferConfig
from eric_epd.wire.handoff import EXTRA_ARGS_KEY
from tests.support.encoded import encoded
from tests.support.helpers_engine import FakeEngine as _FakeEngine
from tests.support.helpers_engine import FakeMedia as _FakeMedia
from tests.support.helpers_engine import items as _items
from tests.support.helpers_engine import settle as _settle
from tests.support.helpers_servers import post_raw as _post_raw
from tests.support.helpers_servers import read_and_ack
from tests.support.helpers_servers import stopped as _stopped
from tests.support.placement import rendezvous_first

STORED = 0x5A
"""What the stand-in store holds for every item (byte value); a late read writes 0xEE."""


class _Store:
    """GlobalCache stand-in: the first `held` reads wait until the test lets them go (then write 0xEE, as a read
    finishing in its thread would); later reads hit at once with STORED bytes."""

    accepting_puts = True

    def __init__(self, held: int, read_wait_s: float = 30.0) -> None:
        self.read_wait_s = read_wait_s
        self.gate = asyncio.Event()
        self.held, self.reads, self.timeouts = held, 0, 0

    async def read_into(self, key: str, region: np.ndarray) -> bool:
        self.reads += 1
        if self.reads <= self.held:
            await self.gate.wait()
            region[:] = 0xEE
            return True
        region[:] = STORED
        return True

    async def write(self, key: str, region: np.ndarray) -> None:
        return None

    def timed_out(self, count: int) -> None:
        self.timeouts += count


@contextmanager
def _service(engine: _FakeEngine, store: _Store | None) -> Iterator[EncodeService]:
    hub = transfer_hub(EricConfig(model=Path("."), transfer=TransferConfig(pool_bytes=1 << 20, backends=())))
    try:
        yield EncodeService(_FakeMedia(), _FakeMedia(), engine, hub, EricMetrics(), OutputSpec(8, "float32"), store)  # type: ignore[arg-type]
    finally:
        hub.close()


def test_a_cancelled_store_read_frees_its_region_and_its_hash() -> None:
    """The request reading x from the store goes away mid-read while another waits for x: the waiter proceeds at
    once with a fresh lease (read anew), the late read lands in the abandoned region only (the waiter's bytes stay
    the store's), and once that read returns the pool holds exactly nothing."""

    async def run() -> None:
        store = _Store(held=1)
        with _service(_FakeEngine(), store) as service:
            owner = asyncio.create_task(service.encode(_items("x")))
            await _settle()
            waiter = asyncio.create_task(service.encode(_items("x")))
            await _settle()
            assert store.reads == 1 and not waiter.done()  # it waits for the owner's read
            owner.cancel()
            [answer] = await asyncio.wait_for(waiter, 30)  # a hang here is the bug
            assert owner.cancelled() and store.reads == 2
            entry = service.hub.pool.holder("x", answer.handle.lease)
            assert (service.hub.pool.view(entry) == STORED).all()
            assert len(service.hub.pool) == 2  # the abandoned region stays held while its read may write
            store.gate.set()
            await _settle()
            assert (service.hub.pool.view(entry) == STORED).all() and len(service.hub.pool) == 1
            assert service.hub.ack("x", answer.handle.lease)[0] == 200
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_store_read_that_outlasts_its_wait_is_left_behind() -> None:
    """The store does not answer within read_wait_s: the request encodes the item itself in a fresh region, the
    store is noted as timed out, and the stuck read's region is freed when that read finally returns."""

    async def run() -> None:
        engine, store = _FakeEngine(), _Store(held=1, read_wait_s=0.2)
        with _service(engine, store) as service:
            request = asyncio.create_task(service.encode(_items("y")))
            for _ in range(300):
                if engine.requests:
                    break
                await asyncio.sleep(0.05)
            assert len(engine.requests) == 1 and store.timeouts == 1 and len(service.hub.pool) == 2
            engine.answer(0, [0])
            [answer] = await request
            store.gate.set()
            await _settle()
            assert len(service.hub.pool) == 1 and service.hub.ack("y", answer.handle.lease)[0] == 200
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_request_waiting_for_anothers_item_gives_up() -> None:
    """The engine never answers: the request encoding z and the one waiting for it both end with a 504 after the
    request timeout; z's space is freed once the engine answers after all."""

    async def run() -> None:
        engine = _FakeEngine()
        engine.request_timeout_s = 0.3
        with _service(engine, None) as service:
            owner = asyncio.create_task(service.encode(_items("z")))
            await _settle()
            waiter = asyncio.create_task(service.encode(_items("z")))
            for task in (owner, waiter):
                with pytest.raises(ApiError) as timed_out:
                    await asyncio.wait_for(task, 30)
                assert timed_out.value.status == 504
            assert len(engine.requests) == 1 and len(service.hub.pool) == 1  # the engine may still write there
            engine.answer(0, [0])
            await _settle()
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


# ---------------------------------------------------------------- a real store master, stopped mid-read


def _encode(eric: EricServer, url: str, timeout_s: float = 120) -> dict:
    r = httpx.post(
        eric.url + "/v1/encode",
        json={"items": [{"modality": "image", "url": url}]},
        headers=eric.headers,
        timeout=timeout_s,
    )
    assert r.status_code == 200, r.text
    return r.json()["items"][0]


def _read_and_ack(eric: EricServer, item: dict) -> np.ndarray:
    return load_safetensors(read_and_ack(eric, item))["embedding"]


def test_store_reads_cut_short_leave_nothing_held(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Eric A shared two images through Mooncake Store; its master then stops answering (SIGSTOP). Eric B's client
    leaves while B reads the first one: once the master resumes, the same image is served again with A's bytes. B
    then asks for the second while the master is stopped: after its read wait B encodes it itself. Every lease
    given back, B's pool holds exactly 0 bytes."""
    key = new_key()
    with StoreMaster(tmp_path / "master.log") as master:
        cache = ("--global-cache", master.address, "--global-cache-bytes", str(64 << 20))
        with running(
            EricServer(qwen2_vl_tiny, api_key=key, extra_args=cache, log_path=tmp_path / "a.log"),
            EricServer(qwen2_vl_tiny, api_key=key, extra_args=cache, log_path=tmp_path / "b.log"),
        ) as (a, b):
            images = [image_data_url(96, 80, seed=9100), image_data_url(88, 72, seed=9101)]
            originals = [_encode(a, url) for url in images]
            assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= 2, 60)
            expected = [_read_and_ack(a, item) for item in originals]
            assert wait_for(lambda: metric(b.url, 'eric_global_cache{event="up"}') == 1, 60), "B never joined"
            left = metric(b.url, 'eric_requests_total{status="499"}')
            with _stopped(master.proc.pid):
                sock = _post_raw(b.port, "/v1/encode", {"items": [{"modality": "image", "url": images[0]}]}, b.headers)
                assert wait_for(
                    lambda: httpx.get(b.url + "/v1/transfer", headers=b.headers).json()["entries"] == 1, 60
                ), "B never reserved the item's region"
                sock.close()  # B's store read is in flight (the master answers nothing)
                assert wait_for(lambda: metric(b.url, 'eric_requests_total{status="499"}') == left + 1, 60)
            again = _encode(b, images[0], timeout_s=60)  # hangs forever if the hash stayed in flight
            assert again["hash"] == originals[0]["hash"]
            assert np.array_equal(_read_and_ack(b, again), expected[0])
            wait_pool_drained(b.url, b.headers)

            with _stopped(master.proc.pid):
                encoded = metric(b.url, 'eric_items_total{modality="image",source="encoded"}')
                second = _encode(b, images[1], timeout_s=90)  # the read waits its bound, then B encodes
                assert metric(b.url, 'eric_items_total{modality="image",source="encoded"}') == encoded + 1
            assert second["hash"] == originals[1]["hash"]
            np.testing.assert_allclose(_read_and_ack(b, second), expected[1], rtol=1e-5, atol=1e-5)
            wait_pool_drained(b.url, b.headers)
            wait_pool_drained(a.url, a.headers)
    assert "global cache" in (tmp_path / "b.log").read_text()


# ---------------------------------------------------------------- acks whose answers were lost


class _SlowAcks(_ThreadServer):
    """A producer whose first ack answer comes too late; the second is `second` (status, message)."""

    def __init__(self, second: tuple[int, str]) -> None:
        self.second, self.attempts, self.bodies = second, 0, []
        self.release = threading.Event()
        super().__init__(Starlette(routes=[Route("/{path:path}", self._ack, methods=["POST"])]))

    async def _ack(self, request: Request) -> Response:
        self.attempts += 1
        self.bodies.append(orjson.loads(await request.body()))
        if self.attempts == 1:
            await asyncio.to_thread(self.release.wait, 30)
            return JSONResponse({"status": "ok"})
        status, message = self.second
        if status == 200:
            return JSONResponse({"status": message})
        return JSONResponse({"error": {"message": message, "code": status}}, status)


@pytest.mark.parametrize(("second", "proven"), [((200, "already acknowledged"), True), ((404, "no lease"), False)])
def test_an_ack_retried_after_a_lost_answer(second: tuple[int, str], proven: bool) -> None:
    """The first attempt goes unanswered and the ack is sent again: the producer's 'already acknowledged' proves
    the bytes; a 404 means the lease ended without this ack (it expired first): a failure, never a success."""
    with _SlowAcks(second) as producer:
        handle = as_handle(
            {
                "hash": "a" * 64,
                "shape": [1],
                "dtype": "uint8",
                "nbytes": 1,
                "producer": producer.url,
                "instance_id": "i",
                "generation": 1,
                "http": producer.url,
                "lease": "t",
            }
        )
        fetcher = EmbeddingFetcher(("http",), http_timeout_s=20)
        try:
            if proven:
                fetcher.ack(handle, attempt_timeout_s=0.5)
            else:
                with pytest.raises(TransferError, match="no longer valid"):
                    fetcher.ack(handle, attempt_timeout_s=0.5)
        finally:
            producer.release.set()
            fetcher.close()
        assert producer.bodies == [{"instance_id": "i"}, {"instance_id": "i", "retry": True}]


# ---------------------------------------------------------------- the same image under two URLs, two Erics


def test_one_lease_per_content_hands_the_engine_one_and_returns_the_others() -> None:
    items = [encoded(h, lease=lease) for h, lease in (("a", "1"), ("b", "2"), ("a", "3"), ("a", "1"))]
    spare = spare_handles(items)
    assert [h.lease for h in spare] == ["3"]  # the same lease twice (one Eric, one call) is no spare
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"u{k}"}} for k in range(4)]}
        ]
    }
    refs = [MediaRef(0, k, "image", f"u{k}") for k in range(4)]
    handed = orjson.loads(with_embeddings(body, refs, items)["vllm_xargs"][EXTRA_ARGS_KEY])
    assert [h["lease"] for h in handed] == ["1", "2"]


def test_an_audio_part_and_a_soundtrack_of_one_content_share_one_lease() -> None:
    """The same clip as an audio part and as a video's soundtrack: one content hash, two leases from Eric. The
    engine gets the audio part's handle for both (it stages one lease), and the soundtrack's own lease is the one
    to give back (before, each list kept its own and the video's soundtrack a given-back one)."""
    audio = encoded("c", lease="A")
    video = encoded("d", lease="V", second_per_grid_ts=1.0, soundtrack=encoded("c", lease="S"))
    assert [h.lease for h in spare_handles([audio, video])] == ["S"]
    assert kept_handles([audio, video])["c" * 64].lease == "A"


def test_one_image_under_two_urls_gives_back_both_leases(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """Two encodings of one image (two URLs, one content hash) land on two Erics: the engine gets one handle for the
    hash and the gateway gives the other Eric's lease back at once; both pools hold exactly 0 bytes, long before
    their 300 s TTL."""
    key = new_key()
    image = random_image(80, 64, seed=9200)
    variants = [data_url(_png(image, k)) for k in range(64)]  # 64 distinct byte strings: both Erics get one
    with (
        running(
            EricServer(qwen2_vl_tiny, api_key=key, log_path=tmp_path / "a.log"),
            EricServer(qwen2_vl_tiny, api_key=key, log_path=tmp_path / "b.log"),
        ) as erics,
        EmbedsEngine(key) as engine,
    ):
        urls = {rendezvous_first(v, [e.url for e in erics]): v for v in variants}
        assert len(urls) == 2, "every variant lands on one Eric"
        gateway = GatewayServer(
            tmp_path / "gateway.log",
            "--encoder-urls",
            ",".join(e.url for e in erics),
            "--colocated-urls",
            engine.url,
            "--health-interval",
            "3600",
            eric_api_key=key,
        )
        with gateway:
            resp = httpx.post(
                gateway.url + "/v1/chat/completions",
                timeout=120,
                json={"model": "m", "messages": image_messages([urls[erics[0].url], urls[erics[1].url]])},
            )
            assert resp.status_code == 200 and resp.headers["x-epd-path"] == "epd", resp.text
        [handle] = engine.handles  # one handle for the one content
        assert engine.read.keys() == {handle["hash"]}
        for eric in erics:
            assert metric(eric.url, 'eric_requests_total{status="200"}') == 1  # each encoded one of the two
            wait_pool_drained(eric.url, eric.headers, timeout_s=30)


def _png(image, k: int) -> bytes:
    """The same pixels as PNG bytes made distinct by a text chunk (compression levels alone often give equal bytes)."""
    import io

    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("variant", str(k))
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()
