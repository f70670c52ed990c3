"""Eric's SGLang routes against hostile callers, no prefill needed: Eric pushes (ZMQ, Mooncake sessions) only to the
caller's address or allowed networks, takes a part's rank calls only from its /encode's address and NIXL sessions only
from allowlisted callers, and answers oversized bodies 413 without reading them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from eric_epd.stack.process import free_port
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url
from eric_epd.wire.sglang import NixlSession, encode_nixl_session
from tests.support.helpers_sglang import IMAGES, items_counter
from tests.support.sglang_probes import ELSEWHERE, Listener, assert_sglang_error, client_from, raw_post, send_body


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    """One Eric on Qwen2-VL that pushes only to its callers and takes NIXL sessions from 127.0.0.1 only (allowlist
    127.0.0.1/32, as Eric A of the prefill harness in tests/support/helpers_sglang.py)."""
    log = tmp_path_factory.mktemp("sglang-hostile") / "eric.log"
    args = ("--transfer-backends", "shm", "--sglang-allowed-peer", "127.0.0.1/32")
    with EricServer(qwen2_vl_tiny, log_path=log, extra_args=args) as server:
        yield server


def encoded_pull_part(client: httpx.Client, eric: EricServer) -> str:
    """A part encoded in SGLang's pull flow (mooncake / NIXL): a rank's size pull beside the /encode."""
    rid = f"{uuid.uuid4().hex}_local_part_0"
    with ThreadPoolExecutor(2) as pool:
        meta = pool.submit(client.post, eric.url + "/scheduler_receive_meta_data", json={"req_id": rid, "part_idx": 0})
        enc = client.post(
            eric.url + "/encode",
            json={
                "req_id": rid,
                "mm_items": [image_data_url(*IMAGES[0])],
                "num_parts": 1,
                "part_idx": 0,
                "modality": "IMAGE",
            },
        )
        assert enc.status_code == 200 and meta.result().status_code == 200, (enc.text, meta.result().text)
    return rid


def test_push_targets_are_the_caller_or_allowed(eric: EricServer) -> None:
    """/encode (zmq_to_tokenizer), /scheduler_receive_url and /send (Mooncake session) naming a host that is neither
    the caller's address nor allowed get 403 before Eric connects anywhere or encodes; so do a part's rank calls
    from another address than its /encode's."""
    listener = Listener()
    client = client_from("127.0.0.1")
    try:
        before = items_counter(eric)
        rid = f"{uuid.uuid4().hex}_local_part_0"
        resp = client.post(
            eric.url + "/encode",
            json={
                "req_id": rid,
                "mm_items": [image_data_url(*IMAGES[0])],
                "num_parts": 1,
                "part_idx": 0,
                "modality": "IMAGE",
                "prefill_host": ELSEWHERE,
                "embedding_port": listener.port,
            },
        )
        assert_sglang_error(resp, 403, "prefill_host", ELSEWHERE, "--sglang-allowed-peer")
        assert resp.json()["req_id"] == rid
        assert items_counter(eric) == before  # refused before anything was encoded

        resp = client.post(
            eric.url + "/scheduler_receive_url",
            json={"req_id": f"{uuid.uuid4().hex}_local_part_0", "receive_count": 1, "receive_url": listener.endpoint},
        )
        assert_sglang_error(resp, 403, "receive_url", ELSEWHERE)

        rid = encoded_pull_part(client, eric)
        resp = client.post(eric.url + "/send", json=send_body(rid, "127.0.0.1", free_port(), listener.endpoint))
        assert_sglang_error(resp, 403, "mooncake session", ELSEWHERE)
        local_session = f"127.0.0.1:{free_port()}"
        resp = client.post(eric.url + "/send", json=send_body(rid, ELSEWHERE, listener.port, local_session))
        assert_sglang_error(resp, 403, "prefill_host", ELSEWHERE)
        time.sleep(0.5)  # a ZMQ or Mooncake connect would be under way by now
        assert not listener.connected(), "Eric connected to a host neither the caller's nor allowed"

        # another address may not act on this part, even pointing at itself
        other, own = client_from("127.0.0.3"), Listener("127.0.0.3")
        try:
            resp = other.post(eric.url + "/send", json=send_body(rid, own.host, own.port, own.endpoint))
            assert_sglang_error(resp, 403, "posted from another address")
            resp = other.post(eric.url + "/scheduler_receive_meta_data", json={"req_id": rid, "part_idx": 0})
            assert_sglang_error(resp, 403, "posted from another address")
            assert not own.connected()
        finally:
            other.close()
            own.close()
    finally:
        client.close()
        listener.close()


def test_nixl_session_only_from_allowed_callers(eric: EricServer) -> None:
    """A NIXL session's UCX addresses are opaque to Eric, so one with allowlist 127.0.0.1/32 refuses one from
    127.0.0.3 with a 403 before any connection, even for 127.0.0.3's own part (nor is that rank notified)."""
    session = encode_nixl_session(NixlSession(agent_metadata=b"\0" * 64, mem_type="DRAM"))
    client, listener = client_from("127.0.0.3"), Listener("127.0.0.3")
    try:
        rid = encoded_pull_part(client, eric)
        resp = client.post(eric.url + "/send", json=send_body(rid, "127.0.0.3", listener.port, session))
        assert_sglang_error(resp, 403, "NIXL session", "--sglang-allowed-peer", "127.0.0.3")
        time.sleep(0.5)
        assert not listener.connected()
        assert httpx.get(eric.url + "/health").status_code == 200
    finally:
        client.close()
        listener.close()


SGLANG_POSTS = ("/encode", "/send", "/scheduler_receive_url", "/scheduler_receive_meta_data")


def test_oversized_bodies_get_413_without_being_read(eric: EricServer) -> None:
    """48 MiB to each SGLang POST route: 413 in SGLang's error shape, declared (Content-Length, answered with most
    of the body unsent) or streamed (chunked); the server keeps serving."""
    big = 48 << 20
    for path in SGLANG_POSTS:
        status, body = raw_post(eric.url, path, big, 1 << 16)
        assert status == 413 and body["status"] == "error" and "limit" in body["message"], (path, status, body)
        resp = httpx.post(eric.url + path, content=b"x" * big, timeout=60)
        assert_sglang_error(resp, 413, "limit")

        def chunks():
            for _ in range(big >> 20):
                yield b"x" * (1 << 20)

        resp = httpx.post(eric.url + path, content=chunks(), timeout=60)  # no Content-Length: streamed
        assert_sglang_error(resp, 413, "limit")
    assert httpx.get(eric.url + "/health", timeout=10).status_code == 200
    resp = httpx.post(
        eric.url + "/scheduler_receive_url",
        json={"req_id": "r", "receive_count": 0, "receive_url": "127.0.0.1:1"},
        timeout=10,
    )
    assert_sglang_error(resp, 400, "receive_count")
