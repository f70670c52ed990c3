"""The raw-bytes alias on a real Eric (router, engine and worker): images resent while their embeddings are in the
content cache are answered without decoding (eric_alias_hits_total), with the first answer's hashes, handles and
rows; other bytes are no hit (of the same size, or the same pixels in another format: then found by content hash);
once the cache dropped them, a resend is decoded and encoded again, to the same rows; and through SGLang's encoder
protocol a resent part is answered from the alias too, with the same payload. Bodies of megabytes fault few pages into
the router, which keeps its freed heap."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq
from safetensors.numpy import load as load_safetensors

from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import data_url, image_bytes, image_data_url, random_image
from eric_epd.testing.pools import wait_pool_drained
from eric_epd.testing.stack import metric
from tests.support.helpers_servers import encode_items, read_and_ack

SIDE = 112
"""Image side: 8 x 8 patches, 16 merged tokens of width 128 in float32 on tiny Qwen2-VL (8 KiB of rows)."""
ROWS = 16 * 128 * 4
KEEP = 5 * ROWS
"""The content cache (--keep-acked-bytes) holds five images' rows: six more evict every older one."""


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    log = tmp_path_factory.mktemp("alias") / "eric.log"
    args = ("--keep-acked-bytes", str(KEEP), "--alias-entries", "64")
    with EricServer(qwen2_vl_tiny, log_path=log, extra_args=args) as server:
        yield server


def _images(*seeds: int) -> list[dict]:
    return [{"id": str(s), "modality": "image", "url": image_data_url(SIDE, SIDE, seed=s)} for s in seeds]


def _encoded(eric: EricServer, items: list[dict]) -> list[dict]:
    resp = encode_items(eric, items)
    assert resp.status_code == 200, resp.text
    return resp.json()["items"]


def _rows(payload: bytes) -> bytes:
    """The embedding's row bytes from a safetensors payload (its one tensor)."""
    (rows,) = load_safetensors(payload).values()
    assert rows.shape == (16, 128) and np.isfinite(rows).all() and rows.any()
    return rows.tobytes()


def _read(eric: EricServer, answers: list[dict]) -> list[bytes]:
    """Every answered item's rows, read with its lease and acknowledged (then kept as content cache)."""
    return [_rows(read_and_ack(eric, item)) for item in answers]


def _hits(eric: EricServer) -> float:
    return metric(eric.url, "eric_alias_hits_total")


def _encoded_items(eric: EricServer) -> float:
    return metric(eric.url, 'eric_items_total{modality="image",source="encoded"}')


def _same_entry(first: dict, again: dict) -> None:
    """`again` answers `first`'s pool entry (its own lease): every field equal but the lease token."""
    assert again["handle"]["lease"] != first["handle"]["lease"]
    assert {**again, "handle": {**again["handle"], "lease": None}} == {
        **first,
        "handle": {**first["handle"], "lease": None},
    }


def test_resent_images_are_answered_without_decoding_until_the_cache_drops_them(eric: EricServer) -> None:
    hits = _hits(eric)
    items = _images(101, 102, 103)
    first = _encoded(eric, items)
    rows = _read(eric, first)
    assert len(set(rows)) == 3 and _hits(eric) == hits
    encoded, decoded = _encoded_items(eric), metric(eric.url, 'eric_stage_seconds_count{stage="decode"}')
    fetched = metric(eric.url, 'eric_stage_seconds_count{stage="fetch"}')

    again = _encoded(eric, items)  # a second turn resends the chat's images
    assert _hits(eric) == hits + 3 and _encoded_items(eric) == encoded  # neither decoded nor encoded
    assert metric(eric.url, 'eric_stage_seconds_count{stage="decode"}') == decoded
    # found by their data: URLs' text, not even base64-decoded (the first sight fetched, i.e. decoded, all three)
    assert metric(eric.url, 'eric_stage_seconds_count{stage="fetch"}') == fetched
    for a, b in zip(first, again):
        _same_entry(a, b)
    assert _read(eric, again) == rows  # byte-equal rows

    # the same pixels as BMP: other bytes, no alias hit, yet the same content hash, answered from the cache
    bmp = data_url(image_bytes(random_image(SIDE, SIDE, seed=101), "BMP"), "image/bmp")
    [as_bmp] = _encoded(eric, [{"id": "bmp", "modality": "image", "url": bmp}])
    assert as_bmp["hash"] == first[0]["hash"] and _hits(eric) == hits + 3 and _encoded_items(eric) == encoded
    assert _read(eric, [as_bmp]) == rows[:1]

    # other bytes of exactly the same size (two BMPs of other pixels): never a hit
    one, two = (image_bytes(random_image(SIDE, SIDE, seed=s), "BMP") for s in (104, 105))
    assert len(one) == len(two) and one != two
    [x] = _encoded(eric, [{"id": "x", "modality": "image", "url": data_url(one, "image/bmp")}])
    [y] = _encoded(eric, [{"id": "y", "modality": "image", "url": data_url(two, "image/bmp")}])
    assert x["hash"] != y["hash"] and _hits(eric) == hits + 3 and _encoded_items(eric) == encoded + 2
    _read(eric, [x, y])

    # more other images than the content cache holds: every entry above is evicted; the alias still names them
    evictions, fill = metric(eric.url, 'eric_local_cache{event="evictions"}'), KEEP // first[0]["handle"]["nbytes"] + 1
    _read(eric, _encoded(eric, _images(*range(110, 110 + fill))))
    assert metric(eric.url, 'eric_local_cache{event="evictions"}') >= evictions + 5
    encoded = _encoded_items(eric)
    third = _encoded(eric, items)  # not in the pool any more: decoded and encoded in full
    assert _hits(eric) == hits + 3 and _encoded_items(eric) == encoded + 3
    assert [t["hash"] for t in third] == [f["hash"] for f in first]
    assert [t["handle"]["generation"] for t in third] != [f["handle"]["generation"] for f in first]
    assert _read(eric, third) == rows
    stats = wait_pool_drained(eric.url, eric.headers)  # nothing held beside the content cache
    assert 0 < stats["cached_bytes"] <= KEEP


def _sglang_part(eric: EricServer, port: int, images: list[str]) -> httpx.Response:
    body = {
        "req_id": f"{uuid.uuid4().hex}_local_part_0",
        "num_parts": 1,
        "part_idx": 0,
        "modality": "IMAGE",
        "mm_items": images,
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
    }
    return httpx.post(eric.url + "/encode", json=body, timeout=120)


def test_a_part_resent_through_sglangs_protocol_is_answered_from_the_alias(eric: EricServer) -> None:
    """zmq_to_tokenizer: each part is pushed to a PULL socket (rows in SGLang's dtype, a copy Eric stages), then its
    leases end (kept as content cache). The same part again: alias hits, the same payload. The same bytes through
    /v1/encode (hop-padded audio settings: another alias key) are found by content hash, not the alias."""
    images = [image_data_url(SIDE, SIDE, seed=s) for s in (201, 202)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        payloads = []
        hits = []
        for _ in range(2):
            hits.append(_hits(eric))
            resp = _sglang_part(eric, port, images)
            assert resp.status_code == 200, resp.text
            assert sock.poll(30_000), "the part never arrived"
            _, payload = sock.recv_multipart()
            payloads.append(bytes(payload))
        assert hits[1] == hits[0] and _hits(eric) == hits[1] + 2
        assert payloads[0] == payloads[1] and len(payloads[0]) >= 2 * 16 * 128 * 2  # two images' rows
        encoded = _encoded_items(eric)
        native = _encoded(eric, [{"id": str(i), "modality": "image", "url": u} for i, u in enumerate(images)])
        assert _hits(eric) == hits[1] + 2 and _encoded_items(eric) == encoded  # cached by content hash
        _read(eric, native)
        wait_pool_drained(eric.url, eric.headers)
    finally:
        sock.close(linger=0)
        ctx.term()


def _minor_faults(pid: int) -> int:
    """The minor page faults process `pid` has taken (/proc/<pid>/stat, field 10)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_bodies_of_megabytes_reuse_the_routers_heap(eric: EricServer) -> None:
    """The router keeps its freed heap (--heap-keep-bytes, on by default): bodies of three 1024 px PNGs (10 MB of
    data: URLs), sent once and then resent, are read, decoded and hashed in memory it already has, so each faults few
    pages in, where glibc's defaults fault about twice the body's pages in each time (5,800 a body, every one, run
    with --heap-keep-bytes 0; tests/common/test_heap.py holds that control in CI)."""
    bodies = [
        [
            {
                "id": str(k),
                "modality": "image",
                "url": data_url(image_bytes(random_image(1024, 1024, 10 * s + k), "PNG")),
            }
            for k in range(3)
        ]
        for s in range(30, 34)
    ]
    pages = sum(len(i["url"]) for i in bodies[0]) // 4096
    faults = []
    for items in [*bodies, *bodies]:
        before = _minor_faults(eric.proc.pid)
        for answered in _encoded(eric, items):
            read_and_ack(eric, answered)
        faults.append(_minor_faults(eric.proc.pid) - before)
    # the first pass may still grow the heap (each arena of the threads that decode, once); the resent one may not
    assert max(faults[len(bodies) :]) < pages / 2 and sorted(faults)[len(faults) // 2] < pages / 4, (faults, pages)
    wait_pool_drained(eric.url, eric.headers)
