"""Security, round 2: forwarded headers believed only from --trusted-proxies (live Erics), SGLang-route state
bounded and expiring (a live Eric's parts and receiver sockets), and handles checked against their producer's own
segment, ports and pool region before a byte lands (a live producer process, real landing sockets)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
import zmq

from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea, LandingChannel
from eric_epd.stack.process import free_port, stop_all
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import metric, wait_for
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher, as_handle
from eric_epd.wire.handles import EmbeddingHandle, HandleError, check_handle
from tests.support.helpers_servers import start_in_threads
from tests.support.sglang_probes import ELSEWHERE, assert_sglang_error, client_from

BOUNDS = (
    "--sglang-max-parts",
    "4",
    "--sglang-req-timeout",
    "3",
    "--sglang-send-timeout",
    "3",
    "--sglang-max-receivers",
    "2",
    "--sglang-receiver-idle-ttl",
    "1",
)


@pytest.fixture(scope="module")
def erics(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EricServer]]:
    """ "plain": no trusted proxy, small SGLang bounds; "proxied": --trusted-proxies 127.0.0.1 (booted together)."""
    tmp = tmp_path_factory.mktemp("round2")
    servers = {
        "plain": EricServer(qwen2_vl_tiny, log_path=tmp / "plain.log", extra_args=BOUNDS),
        "proxied": EricServer(
            qwen2_vl_tiny, log_path=tmp / "proxied.log", extra_args=("--trusted-proxies", "127.0.0.1")
        ),
    }
    join = start_in_threads(servers.values())
    try:
        join()
        yield servers
    finally:
        stop_all(*servers.values(), hurry=True)  # no test here drains


def _register(
    client: httpx.Client, eric: EricServer, receive_url: str, forwarded: str | None = None, rid: str | None = None
) -> httpx.Response:
    headers = {"X-Forwarded-For": forwarded} if forwarded else {}
    return client.post(
        eric.url + "/scheduler_receive_url",
        headers=headers,
        json={"req_id": rid or f"{uuid.uuid4().hex}_local_part_0", "receive_count": 1, "receive_url": receive_url},
    )


def _parts(eric: EricServer) -> float:
    return metric(eric.url, 'eric_sglang_state{kind="parts"}')


def test_forwarded_for_is_believed_only_from_trusted_proxies(erics) -> None:
    """A loopback caller's X-Forwarded-For changes nothing on a plain Eric (its peer stays 127.0.0.1); with
    --trusted-proxies 127.0.0.1 it names the peer, but not when sent from an untrusted address."""
    plain, proxied = erics["plain"], erics["proxied"]
    local, elsewhere = client_from("127.0.0.1"), client_from(ELSEWHERE)
    try:
        there, here = f"{ELSEWHERE}:{free_port()}", f"127.0.0.1:{free_port()}"
        assert_sglang_error(
            _register(local, plain, there, forwarded=ELSEWHERE), 403, "receive_url", ELSEWHERE, "(127.0.0.1)"
        )
        assert _register(local, plain, here, forwarded=ELSEWHERE).status_code == 200  # still 127.0.0.1's own

        assert _register(local, proxied, there, forwarded=ELSEWHERE).status_code == 200  # the proxy's word
        assert_sglang_error(_register(local, proxied, here, forwarded=ELSEWHERE), 403, "receive_url", f"({ELSEWHERE})")
        assert_sglang_error(
            _register(elsewhere, proxied, here, forwarded="127.0.0.1"), 403, "receive_url", f"({ELSEWHERE})"
        )  # 127.0.0.2 is no trusted proxy: its header is ignored
        assert _register(elsewhere, proxied, there, forwarded="127.0.0.1").status_code == 200
    finally:
        local.close()
        elsewhere.close()


def test_sglang_parts_are_bounded_and_expire(erics) -> None:
    """Twelve distinct req_ids against --sglang-max-parts 4: four are held, the rest (and a new /encode) get 503
    naming the flag; the held ones are released idle after the request timeout, then new ones are taken again."""
    eric = erics["plain"]
    client = client_from("127.0.0.1")
    try:
        assert wait_for(lambda: _parts(eric) == 0, timeout_s=30)
        statuses = []
        for _ in range(12):
            resp = _register(client, eric, f"127.0.0.1:{free_port()}")
            statuses.append(resp.status_code)
            if resp.status_code == 503:
                assert_sglang_error(resp, 503, "--sglang-max-parts")
            assert _parts(eric) <= 4
        assert statuses == [200] * 4 + [503] * 8, statuses
        resp = client.post(
            eric.url + "/encode",
            json={
                "req_id": f"{uuid.uuid4().hex}_local_part_0",
                "mm_items": [image_data_url(32, 32)],
                "num_parts": 1,
                "part_idx": 0,
                "modality": "IMAGE",
            },
        )
        assert_sglang_error(resp, 503, "--sglang-max-parts")
        assert _parts(eric) == 4
        assert wait_for(lambda: _parts(eric) == 0, timeout_s=30), "idle parts were not released"
        assert _register(client, eric, f"127.0.0.1:{free_port()}").status_code == 200
        assert _parts(eric) == 1
    finally:
        client.close()


def test_sglang_receiver_sockets_are_bounded_and_expire(erics) -> None:
    """Parts delivered to five distinct rank endpoints (real ZMQ PULL sockets) through --sglang-max-receivers 2:
    every rank gets its part, at most two sockets stay cached, and they are closed once idle."""
    eric = erics["plain"]
    client = client_from("127.0.0.1")
    ctx = zmq.Context()
    pulls = []
    try:
        warm = httpx.post(
            eric.url + "/v1/encode",
            headers=eric.headers,
            timeout=120,
            json={"items": [{"modality": "image", "url": image_data_url(40, 40, 9)}]},
        )
        assert warm.status_code == 200, warm.text
        assert wait_for(lambda: _parts(eric) == 0, timeout_s=30)
        for i in range(5):
            pull = ctx.socket(zmq.PULL)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            pulls.append(pull)
            rid = f"{uuid.uuid4().hex}_local_part_0"
            assert _register(client, eric, f"127.0.0.1:{port}", rid=rid).status_code == 200
            resp = client.post(
                eric.url + "/encode",
                json={
                    "req_id": rid,
                    "mm_items": [image_data_url(40, 40, i)],
                    "num_parts": 1,
                    "part_idx": 0,
                    "modality": "IMAGE",
                },
            )
            assert resp.status_code == 200, resp.text
            assert pull.poll(30_000), f"rank {i} got nothing"
            frames = pull.recv_multipart()
            assert len(frames) == 2 and len(frames[1]) > 0  # header and rows
            assert metric(eric.url, 'eric_sglang_state{kind="receivers"}') <= 2
        assert wait_for(lambda: metric(eric.url, 'eric_sglang_state{kind="receivers"}') == 0, timeout_s=30)
    finally:
        for pull in pulls:
            pull.close(linger=0)
        ctx.term()
        client.close()


def test_trusted_proxies_flag_is_checked() -> None:
    """Every server's --trusted-proxies takes IPs and CIDRs only; none turns uvicorn's proxy headers off."""
    from epd_gateway.config import parse_args

    from eric_epd.common.proxies import parse_trusted_proxies, uvicorn_proxy_settings

    config = parse_args(["--colocated-urls", "http://127.0.0.1:1", "--trusted-proxies", "10.0.0.0/8, 127.0.0.1"])
    assert config.trusted_proxies == ("10.0.0.0/8", "127.0.0.1/32")
    assert parse_args(["--colocated-urls", "http://127.0.0.1:1"]).trusted_proxies == ()
    assert uvicorn_proxy_settings(()) == {"proxy_headers": False, "forwarded_allow_ips": []}
    assert uvicorn_proxy_settings(("::1",)) == {"proxy_headers": True, "forwarded_allow_ips": ["::1/128"]}
    for bad in ("*", "proxy.example", "10.0.0.0/33"):
        with pytest.raises(ValueError, match="not an IP address or CIDR"):
            parse_trusted_proxies(bad)
        with pytest.raises(SystemExit):
            parse_args(["--colocated-urls", "http://127.0.0.1:1", "--trusted-proxies", bad])


# ---- handles against their producer's own locations --------------------------------------------------------------

SENTINEL = 0x5A


@pytest.fixture(scope="module")
def producer() -> Iterator[PoolServer]:
    with PoolServer(backends="shm,mooncake", pool_bytes=1 << 20) as server:
        yield server


def _entries(producer: PoolServer) -> int:
    return httpx.get(producer.url + "/v1/transfer", timeout=30).json()["entries"]


def test_handles_must_name_their_producers_own_segment_region_and_port(producer) -> None:
    """Handles with a negative offset, an offset past the pool, a foreign shm segment (that exists, with other
    bytes), a foreign Mooncake port or an address below the pool are refused by the landing ranks: the request
    fails, the landing area keeps its bytes and the producer's lease is untouched; a good handle lands exactly."""
    rows = torch.arange(32, dtype=torch.float32).reshape(4, 8) / 7
    resp = httpx.post(
        producer.url + "/v1/testing/entries",
        timeout=60,
        json={
            "hash": "r" * 64,
            "data": base64.b64encode(rows.numpy().tobytes()).decode(),
            "shape": [4, 8],
            "dtype": "float32",
        },
    )
    assert resp.status_code == 200, resp.text
    good = as_handle(resp.json())
    described = httpx.get(producer.url + "/v1/transfer", timeout=30).json()
    assert (
        described["shm"]["name"] == good.shm.name
        and described["mooncake"]["session_id"] == good.mooncake.session_id
        and described["pool_bytes"] == 1 << 20
    )
    foreign = SharedMemory(create=True, size=1 << 20, name=f"eric-pool-{uuid.uuid4().hex[:16]}")
    foreign.buf[:] = b"\xab" * (1 << 20)
    host, port = good.mooncake.session_id.rsplit(":", 1)
    shm, mc = good.shm, good.mooncake
    bad: dict[str, tuple[EmbeddingHandle, str]] = {
        "negative offset": (msgspec.structs.replace(good, shm=msgspec.structs.replace(shm, offset=-256)), "outside"),
        "past the pool": (
            msgspec.structs.replace(good, shm=msgspec.structs.replace(shm, offset=(1 << 20) - 64)),
            "outside",
        ),
        "far past the pool": (
            msgspec.structs.replace(good, shm=msgspec.structs.replace(shm, offset=1 << 30)),
            "outside",
        ),
        "foreign segment": (
            msgspec.structs.replace(good, shm=msgspec.structs.replace(shm, name=foreign.name)),
            "is not",
        ),
        "foreign port": (
            msgspec.structs.replace(good, mooncake=msgspec.structs.replace(mc, session_id=f"{host}:{int(port) + 1}")),
            "is not",
        ),
        "below the pool": (
            msgspec.structs.replace(good, mooncake=msgspec.structs.replace(mc, addr=mc.addr - 4096)),
            "outside",
        ),
    }
    address = LandingAddress(f"round2{uuid.uuid4().hex[:8]}")
    area = LandingArea(address, 0, 4096, torch.device("cpu"), EmbeddingFetcher(("shm", "mooncake", "http")), 1)
    channel = LandingChannel(address, 1)
    fetcher = EmbeddingFetcher(("shm", "http"))
    try:
        area.buffer.fill_(SENTINEL)
        for what, (h, words) in bad.items():
            with pytest.raises(TransferError, match=words):
                channel.land(0, h, 30.0)
            assert bool((area.buffer == SENTINEL).all()), f"{what}: bytes landed"
            dst = np.full(h.nbytes, SENTINEL, np.uint8)
            with pytest.raises(HandleError, match=words):
                fetcher.read_into(h, dst)
            assert bool((dst == SENTINEL).all()), f"{what}: bytes read"
            assert _entries(producer) == 1, what
        with pytest.raises(HandleError, match="negative"):  # also refused before any producer is asked
            check_handle(bad["negative offset"][0], (good.producer,), 8)
        with pytest.raises(HandleError, match="negative"):
            check_handle(
                msgspec.structs.replace(good, mooncake=msgspec.structs.replace(mc, addr=-1)), (good.producer,), 8
            )

        assert channel.land(256, good, 30.0) == "shm"
        assert torch.equal(area.tensor(256, (4, 8), "float32", torch.float32), rows)
        assert bool((area.buffer[:256] == SENTINEL).all())
        fetcher.ack(good)
        assert _entries(producer) == 0
    finally:
        channel.close()
        area.close()
        fetcher.close()
        foreign.close()
        foreign.unlink()
