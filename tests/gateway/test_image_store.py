"""The gateway's store of generated PNGs (`response_format: "url"`): each kept under an unguessable name until its
TTL or until the byte budget needs its room (oldest first; the newest is kept even alone over the budget); unknown,
expired and malformed names find nothing; settings that would make every link dead or the store unbounded are
refused at start-up. The clock is the module's own, moved by hand (no sleeps)."""

from __future__ import annotations

import math

import pytest
from epd_gateway import image_store
from epd_gateway.config import GatewayConfig
from epd_gateway.image_store import ImageStore


class Clock:
    """time.monotonic as the store reads it, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(image_store.time, "monotonic", c)
    return c


def test_an_image_lasts_its_ttl_and_no_longer(clock: Clock) -> None:
    store = ImageStore(ttl_s=60, max_bytes=1 << 20)
    a = store.put(b"a" * 10)
    clock.now += 30
    b = store.put(b"b" * 10)
    assert store.get(a) == b"a" * 10 and store.get(b) == b"b" * 10
    clock.now += 30  # a's time is up, b's is not
    assert store.get(a) is None and store.get(b) == b"b" * 10
    clock.now += 30
    assert store.get(b) is None


def test_the_byte_budget_drops_the_oldest_and_keeps_the_newest(clock: Clock) -> None:
    store = ImageStore(ttl_s=60, max_bytes=25)
    first, second = store.put(b"1" * 10), store.put(b"2" * 10)
    third = store.put(b"3" * 10)  # 30 > 25: the oldest goes
    assert store.get(first) is None and store.get(second) == b"2" * 10 and store.get(third) == b"3" * 10
    big = store.put(b"4" * 40)  # alone over the budget: every other goes, it stays
    assert [store.get(n) for n in (second, third)] == [None, None] and store.get(big) == b"4" * 40


def test_names_are_unguessable_and_only_exact_ones_find_anything(clock: Clock) -> None:
    store = ImageStore(ttl_s=60, max_bytes=1 << 20)
    names = {store.put(b"x") for _ in range(50)}
    assert len(names) == 50 and all(len(n) == 26 and n.endswith(".png") for n in names)
    name = next(iter(names))
    for wrong in (name[:-4], name.upper() if name != name.upper() else name.lower(), "../" + name, name + "x", ""):
        assert store.get(wrong) is None, wrong
    assert store.get(name) == b"x"


@pytest.mark.parametrize("ttl, nbytes", [(0, 1 << 20), (-1, 1 << 20), (math.nan, 1), (math.inf, 1), (60, 0)])
def test_settings_that_make_links_dead_or_the_store_unbounded_are_refused(ttl: float, nbytes: int) -> None:
    with pytest.raises(ValueError, match="image-url-ttl"):
        GatewayConfig(colocated_urls=("http://e:1",), image_url_ttl_s=ttl, image_store_bytes=nbytes)
    assert GatewayConfig(colocated_urls=("http://e:1",), image_url_ttl_s=60, image_store_bytes=1).image_store_bytes == 1
