"""The raw-bytes alias without processes: a bounded LRU whose keys change with the modality, the hop padding, the
soundtrack flag, the bytes and the hash salt (the video sampling included); a hit only while the pool holds the
hash written; through EncodeService (fake engine, real pool), a resent item is leased without being prepared, and
every lease a hit took is given back when its request fails or is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from eric_epd.common.errors import ApiError
from eric_epd.eric.alias import RawAlias, alias_keys, data_url_keys, light
from eric_epd.eric.answers import OutputSpec, Staging
from eric_epd.eric.config import EricConfig
from eric_epd.eric.launch import transfer_hub
from eric_epd.eric.metrics import EricMetrics
from eric_epd.eric.processor import PreparedItem, Processor
from eric_epd.eric.service import EncodeService
from eric_epd.eric.workload import work_item
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError
from eric_epd.models.processor import ProcessedItem
from eric_epd.testing.pools import assert_books_exact, assert_pool_empty
from eric_epd.transfer.config import TransferConfig
from eric_epd.transfer.producer import Want
from eric_epd.wire.eric import EncodeItem
from tests.support.helpers_engine import FakeEngine, items, settle

SALTS = {"image": b"image-salt", "video": b"video-salt", "audio": b"audio-salt"}


def _prepared(key: str, modality: str = "image", **meta: object) -> PreparedItem:
    pixels = np.ones((16, 12), np.float32)
    return PreparedItem(key, ProcessedItem(modality, pixels, (1, 4, 4), 4, **meta), (0.1, 0.2, 0.3))  # type: ignore[arg-type]


def test_keys_change_with_every_setting_and_unknown_modalities_have_none() -> None:
    alias = RawAlias(8, SALTS)
    data = b"the same bytes"
    keys = {
        alias.key("video", data),
        alias.key("audio", data),  # a video's bytes read as audio never alias the video
        alias.key("audio", data, sglang=True),  # SGLang's unpadded audio hashes otherwise
        alias.key("audio", data, soundtrack=True),
        alias.key("audio", data, sglang=True, soundtrack=True),
        alias.key("image", data),
        alias.key("image", data + b"!"),
        RawAlias(8, {"image": b"other model"}).key("image", data),
    }
    assert len(keys) == 8 and None not in keys
    assert alias.key("image", data) == RawAlias(8, dict(SALTS)).key("image", data)  # deterministic
    assert RawAlias(8, {"image": b"s"}).key("audio", data) is None  # a model without audio: nothing to alias


def test_keys_follow_the_processors_salts(qwen2_vl_tiny: Path) -> None:
    """Processor.salts carries the video sampling: another --video-fps is another key for the same video bytes;
    the image key does not move with it."""
    from eric_epd.models.facts import ModelFacts
    from eric_epd.models.registry import load_processor

    facts = ModelFacts.from_checkpoint(qwen2_vl_tiny)
    mp = load_processor(facts.model_dir, facts.config)
    processors = [Processor(mp, MediaLimits(video_fps=fps), 1, b"model") for fps in (2.0, 1.0)]
    processors.append(Processor(mp, MediaLimits(), 1, b"another model"))
    try:
        a, b, other = (RawAlias(4, p.salts) for p in processors)
        assert a.key("video", b"v") != b.key("video", b"v") and a.key("image", b"i") == b.key("image", b"i")
        assert other.key("image", b"i") != a.key("image", b"i")
    finally:
        for processor in processors:
            processor.close()


def test_the_lru_is_bounded_and_keeps_the_recently_used() -> None:
    alias = RawAlias(2, SALTS)
    ready = {"a", "b", "c"}.__contains__
    ka, kb, kc = (alias.key("image", n) for n in (b"a", b"b", b"c"))
    alias.remember(ka, _prepared("a"))
    alias.remember(kb, _prepared("b"))
    assert alias.find(ka, ready) is not None  # a is now the most recently used
    alias.remember(kc, _prepared("c"))
    assert len(alias) == 2 and alias.find(kb, ready) is None
    assert {alias.find(k, ready).hash for k in (ka, kc)} == {"a", "c"}  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        RawAlias(0, SALTS)


def test_a_hit_only_while_the_pool_holds_the_hash_written() -> None:
    alias = RawAlias(4, SALTS)
    key = alias.key("image", b"x")
    alias.remember(key, _prepared("x"))
    config = EricConfig(model=Path("."), transfer=TransferConfig(pool_bytes=1 << 16, backends=()))
    hub = transfer_hub(config)
    try:
        pool = hub.pool
        assert alias.find(key, pool.written) is None  # never encoded here
        entry = pool.reserve("x", 128, (4, 8), "float32")
        assert entry is not None and alias.find(key, pool.written) is None  # reserved, not written yet
        pool.commit("x")
        assert alias.find(key, pool.written) is not None and len(pool) == 1  # the query leased nothing
        pool.release("x")
        assert alias.find(key, pool.written) is None and len(alias) == 1  # gone from the pool; the alias stays
        assert alias.find(None, pool.written) is None
    finally:
        hub.close()


def test_a_light_item_keeps_the_metadata_and_can_never_be_encoded() -> None:
    full = _prepared("v", "video", second_per_grid_ts=1.0, timestamps=(0.0, 1.0), feature_frames=None)
    item = light(full)
    assert item.aliased and item.hash == "v" and item.item.pixel_values.shape == (0, 12)
    assert (item.item.grid_thw, item.item.num_tokens, item.item.timestamps) == ((1, 4, 4), 4, (0.0, 1.0))
    assert item.item.second_per_grid_ts == 1.0 and item.seconds == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no input tensors"):
        work_item(item.hash, item.item, 0, 128)
    alias = RawAlias(4, SALTS)
    alias.remember(alias.key("video", b"v"), full)
    stored = alias.find(alias.key("video", b"v"), lambda _: True)
    assert stored is not None and stored.aliased and stored.item.pixel_values.size == 0


def test_a_data_urls_key_is_its_texts_apart_from_any_bytes_key() -> None:
    alias = RawAlias(8, SALTS)
    url = "data:image/png;base64,eA=="
    key = alias.data_url_key(EncodeItem(id="0", modality="image", url=url))
    assert key is not None and key == alias.data_url_key(EncodeItem(id="other", modality="image", url=url))
    others = {
        alias.key("image", url.encode()),  # the text as bytes: another kind of key
        alias.key("image", b"x"),  # what it decodes into
        alias.data_url_key(EncodeItem(id="0", modality="image", url=url), sglang=True),
        alias.data_url_key(EncodeItem(id="0", modality="image", url=url + "=")),
        alias.data_url_key(EncodeItem(id="0", modality="video", url=url)),
    }
    assert key not in others and len(others) == 5
    with_track = EncodeItem(id="0", modality="video", url="data:video/mp4;base64,AA==", use_audio_in_video=True)
    assert alias.data_url_key(with_track) is None  # keyed by its bytes, as its soundtrack is
    assert RawAlias(8, {"image": b"s"}).data_url_key(EncodeItem(id="0", modality="audio", url=url)) is None


def test_large_bytes_and_data_urls_are_keyed_off_the_event_loop_to_the_same_keys() -> None:
    alias = RawAlias(4, SALTS)
    jobs = [("video", bytes(300_000)), ("audio", bytes(300_000))]
    keys = asyncio.run(alias_keys(alias, jobs, 1))
    assert keys == [alias.key("video", jobs[0][1]), alias.key("audio", jobs[1][1], soundtrack=True)]
    items = [EncodeItem(id="0", modality="image", url="data:image/png;base64," + "A" * 300_000)]
    items.append(EncodeItem(id="1", modality="image", url="https://host/a.png"))
    assert asyncio.run(data_url_keys(alias, items)) == [alias.data_url_key(items[0]), None]


# ---------------------------------------------------------------- through EncodeService (fake engine, real pool)


class _Media:
    """Fetcher and processor in one: the URL names the content; `bad*` fails to decode; `gate` (when set) holds
    every prepare until the test opens it. Records what it was asked to prepare."""

    salts = SALTS

    def __init__(self) -> None:
        self.prepared: list[tuple[str, str]] = []
        self.fetched: list[str] = []
        self.gate: asyncio.Event | None = None

    async def fetch(self, url: str) -> bytes:
        self.fetched.append(url)
        if url.startswith("unreachable"):
            raise MediaError(400, "could not fetch")
        return url.encode()

    async def prepare_many(
        self, jobs: list[tuple[str, bytes]], sglang: bool = False
    ) -> list[PreparedItem | MediaError]:
        self.prepared += [(m, d.decode()) for m, d in jobs]
        if self.gate is not None:
            await self.gate.wait()
        return [
            MediaError(400, "corrupt") if d.startswith(b"bad") else _prepared(f"{m}:{d.decode()}", m) for m, d in jobs
        ]


@contextmanager
def _service(engine: FakeEngine, keep_acked_bytes: int = 0) -> Iterator[tuple[EncodeService, _Media, EricMetrics]]:
    config = EricConfig(
        model=Path("."), transfer=TransferConfig(pool_bytes=1 << 16, keep_acked_bytes=keep_acked_bytes, backends=())
    )
    hub = transfer_hub(config)
    media, metrics = _Media(), EricMetrics()
    try:
        yield (
            EncodeService(media, media, engine, hub, metrics, OutputSpec(8, "float32"), alias=RawAlias(64, SALTS)),
            media,
            metrics,
        )
    finally:
        hub.close()


def _hits(metrics: EricMetrics, modality: str = "image") -> float:
    return metrics.registry.get_sample_value("eric_alias_hits_total", {"modality": modality}) or 0.0


def _cached(metrics: EricMetrics) -> float:
    return metrics.registry.get_sample_value("eric_items_total", {"modality": "image", "source": "cached"}) or 0.0


async def _encoded(service: EncodeService, engine: FakeEngine, request: list[EncodeItem]) -> list:
    """`request` encoded, its one engine request answered in full."""
    task = asyncio.create_task(service.encode(request))
    await settle()
    engine.answer(len(engine.requests) - 1, list(range(len(engine.requests[-1][1]))))
    return await asyncio.wait_for(task, 5)


def _ack(service: EncodeService, answers: list) -> None:
    for answer in answers:
        for a in (answer, answer.soundtrack) if answer.soundtrack is not None else (answer,):
            assert service.hub.ack(a.handle.hash, a.handle.lease)[0] == 200


def test_a_resent_item_still_in_the_pool_is_leased_without_being_prepared() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with _service(engine) as (service, media, metrics):
            first = await _encoded(service, engine, items("x", "y"))
            media.prepared.clear()
            again = await asyncio.wait_for(service.encode(items("y", "x", "x")), 5)
            assert media.prepared == [] and len(engine.requests) == 1  # neither prepared nor encoded again
            assert _hits(metrics) == 3 and _cached(metrics) == 2  # one lease per distinct hash, as before
            assert [a.handle.hash for a in again] == ["image:y", "image:x", "image:x"]
            assert all(a.prepared.aliased and a.prepared.item.num_tokens == 4 for a in again)
            assert again[1].handle.lease == again[2].handle.lease != first[0].handle.lease
            assert all(len(service.hub.pool.get(k).leases) == 2 for k in ("image:x", "image:y"))  # type: ignore[union-attr]
            _ack(service, first)
            _ack(service, again[:2])
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_resent_data_url_is_neither_fetched_nor_prepared_and_a_failing_sibling_gives_its_lease_back() -> None:
    async def run() -> None:
        engine, url = FakeEngine(), "data:image/png;base64,eA=="
        request = [EncodeItem(id="0", modality="image", url=url)]
        with _service(engine) as (service, media, metrics):
            first = await _encoded(service, engine, request)
            assert media.fetched == [url] and media.prepared == [("image", url)]
            again = await asyncio.wait_for(service.encode(request), 5)
            assert media.fetched == [url] and len(media.prepared) == 1 and _hits(metrics) == 1  # not decoded again
            assert again[0].handle.hash == first[0].handle.hash and again[0].prepared.aliased
            assert (entry := service.hub.pool.get(first[0].handle.hash)) is not None and len(entry.leases) == 2
            with pytest.raises(ApiError) as refused:  # the hit leased before its sibling's fetch failed
                await service.encode([*request, EncodeItem(id="1", modality="image", url="unreachable")])
            assert refused.value.status == 400 and "item 1" in refused.value.message and len(entry.leases) == 2
            # negative control: the same bytes behind another URL are fetched and prepared again
            other = await _encoded(service, engine, [EncodeItem(id="0", modality="image", url=url + "#")])
            assert media.fetched[-1] == url + "#" and media.prepared[-1] == ("image", url + "#")
            for answers in (first, again, other):
                _ack(service, answers)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_hash_not_written_or_gone_from_the_pool_is_prepared_in_full() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with _service(engine) as (service, media, metrics):
            first = asyncio.create_task(service.encode(items("x")))
            await settle()  # x is aliased now, but only reserved: a second request prepares it and waits for it
            second = asyncio.create_task(service.encode(items("x")))
            await settle()
            assert media.prepared == [("image", "x")] * 2 and len(engine.requests) == 1
            engine.answer(0, [0])
            answers = await asyncio.wait_for(asyncio.gather(first, second), 5)
            assert _hits(metrics) == 0
            _ack(service, [a for answer in answers for a in answer])  # freed at the last ack (no content cache)
            assert service.hub.pool.get("image:x") is None
            third = await _encoded(service, engine, items("x"))  # the alias names it, the pool does not hold it
            assert media.prepared == [("image", "x")] * 3 and len(engine.requests) == 2 and _hits(metrics) == 0
            assert not third[0].prepared.aliased
            _ack(service, third)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_the_content_cache_answers_a_hit_and_other_bytes_are_no_hit() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with _service(engine, keep_acked_bytes=1 << 12) as (service, media, metrics):
            _ack(service, await _encoded(service, engine, items("x")))
            assert len(service.hub.pool) == 0 and service.hub.pool.written("image:x")  # kept as cache only
            media.prepared.clear()
            again = await _encoded(service, engine, items("x", "z"))  # z: other bytes, prepared and encoded
            assert media.prepared == [("image", "z")] and [w.key for w in engine.requests[1][1]] == ["image:z"]
            assert _hits(metrics) == 1 and again[0].prepared.aliased and not again[1].prepared.aliased
            _ack(service, again)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_videos_soundtrack_and_its_video_alias_apart() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with _service(engine) as (service, media, metrics):
            request = [EncodeItem(id="v", modality="video", url="clip", use_audio_in_video=True)]
            first = await _encoded(service, engine, request)
            assert (first[0].handle.hash, first[0].soundtrack.handle.hash) == ("video:clip", "audio:clip")  # type: ignore[union-attr]
            media.prepared.clear()
            again = await asyncio.wait_for(service.encode(request), 5)
            assert media.prepared == [] and (_hits(metrics, "video"), _hits(metrics, "audio")) == (1, 1)
            assert again[0].soundtrack is not None and again[0].soundtrack.handle.hash == "audio:clip"
            # the same bytes as an audio item of their own: another key (not a soundtrack), prepared in full
            audio = await asyncio.wait_for(service.encode([EncodeItem(id="a", modality="audio", url="clip")]), 5)
            assert media.prepared == [("audio", "clip")] and _hits(metrics, "audio") == 1
            for answers in (first, again, audio):
                _ack(service, answers)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_hits_lease_is_given_back_when_a_sibling_fails_or_the_request_is_cancelled() -> None:
    async def run() -> None:
        engine = FakeEngine()
        with _service(engine) as (service, media, metrics):
            first = await _encoded(service, engine, items("x"))
            with pytest.raises(ApiError) as refused:
                await service.encode(items("x", "bad"))
            assert refused.value.status == 400 and "item 1" in refused.value.message
            entry = service.hub.pool.get("image:x")
            assert entry is not None and len(entry.leases) == 1  # only the first request's lease is left
            media.gate = asyncio.Event()
            cancelled = asyncio.create_task(service.encode(items("x", "y")))  # x a hit, y held in prepare
            await settle()
            assert len(entry.leases) == 2
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert len(entry.leases) == 1 and _hits(metrics) == 2
            assert (
                service.admission.admitted == 0
                and service.alias.find(  # type: ignore[union-attr]
                    service.alias.key("image", b"bad"),  # type: ignore[union-attr]
                    lambda _: True,
                )
                is None
            )  # a failed item is never aliased
            _ack(service, first)
            assert_books_exact(service.hub.pool)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())


def test_a_staging_callers_hits_reserve_its_space_and_give_their_leases_back_when_it_cannot() -> None:
    """SGLang's route asks for a dtype copy beside its items (Staging): with every item an alias hit, the copy is
    reserved alone, sized from the hits' token counts; a copy that can never fit is a 413 that gives the hits'
    leases back."""

    async def run() -> None:
        engine = FakeEngine()
        with _service(engine) as (service, media, metrics):
            first = await _encoded(service, engine, items("x", "y"))
            sizes: list[int] = []

            def want(size: int) -> Staging:
                def wants(prepared: list[PreparedItem]) -> list[Want]:
                    tokens = sum(p.item.num_tokens for p in prepared)
                    sizes.append(tokens)
                    return [Want(f"stage:{len(sizes)}", size, (tokens, 8), "float16")]

                return Staging(wants)

            staging = want(256)
            again = await asyncio.wait_for(service.encode(items("x", "y"), sglang=True, staging=staging), 5)
            assert _hits(metrics) == 0 and len(engine.requests) == 1  # sglang=True: other keys, no hit
            assert media.prepared[-2:] == [("image", "x"), ("image", "y")]  # prepared, then found by content hash
            staging_hit = want(256)
            hit = await asyncio.wait_for(service.encode(items("x", "y"), sglang=True, staging=staging_hit), 5)
            assert _hits(metrics) == 2 and sizes[-1] == 8 and staging_hit.entries is not None
            assert [e.hash for e in staging_hit.entries] == ["stage:2"] and staging_hit.entries[0].nbytes == 256
            with pytest.raises(ApiError) as refused:
                await service.encode(items("x", "y"), sglang=True, staging=want(1 << 20))
            assert refused.value.status == 413 and _hits(metrics) == 4
            assert all(len(service.hub.pool.get(k).leases) == 3 for k in ("image:x", "image:y"))  # type: ignore[union-attr]
            for s in (staging, staging_hit):
                for entry in s.entries or ():
                    service.hub.release(entry)
            for answers in (first, again, hit):
                _ack(service, answers)
            assert_pool_empty(service.hub.pool)

    asyncio.run(run())
