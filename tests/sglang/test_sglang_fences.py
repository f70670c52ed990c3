"""SGLang parts never outlive their region: a zero-copy push to a receiver that takes nothing is dropped before its
region can be reused (the receiver never gets the old header over the next owner's bytes), and a part whose encode
outlasts the send timeout is not swept under it (its leases and dtype copy return when it ends); parts whose dtype
copies need pool space take turns instead of each holding rows while waiting for space only another can free."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import zmq

from eric_epd.eric.sglang.zmq_push import ZmqSender
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.pools import held_bytes
from eric_epd.testing.stack import wait_for

MESSAGE_BYTES = 32 << 20
"""Far more than the kernel's socket buffers hold: a receiver that reads nothing leaves the send unfinished."""


IMAGE_ROWS = 4 * 128 * 4
"""A 64x64 image's float32 rows on tiny Qwen2-VL: 4 merged tokens of width 128 (2 KiB)."""
POOL_BYTES = 4 * IMAGE_ROWS
"""Two parts of two images hold the whole pool with their float32 rows; one part and its bfloat16 copy fit."""


class SlowReceiver:
    """A PULL socket that reads nothing until `start`, then records every message's header and payload digest."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 64 << 10)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.got: list[tuple[bytes, set[int]]] = []
        self._go = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        self._go.wait()
        while True:
            try:
                header, payload = self.sock.recv_multipart()
            except zmq.ZMQError:  # the context is terminating: this thread owns the socket and closes it
                self.sock.close(linger=0)
                return
            self.got.append((header, set(np.unique(np.frombuffer(payload, np.uint8)).tolist())))

    def start(self) -> None:
        self._go.set()

    def close(self) -> None:
        self._go.set()
        self.ctx.term()  # wakes the reader's recv with ETERM, and returns once it closed its socket


def test_a_push_that_cannot_go_is_dropped_before_its_region_is_reused() -> None:
    """A first message fills the receiver's queue (it reads nothing yet); owner A's push then times out; its region
    is reused by owner B (new bytes) and B's message is pushed: the receiver gets the first message and B's header
    with B's bytes, never A's header."""
    first = np.full(MESSAGE_BYTES, 0x11, np.uint8)
    region = np.full(MESSAGE_BYTES, 0xAA, np.uint8)  # a pool region, read in place by ZMQ
    receiver = SlowReceiver()
    endpoint = f"127.0.0.1:{receiver.port}"

    async def scenario() -> None:
        sender = ZmqSender(timeout_s=0.5)
        try:
            await sender.push(endpoint, [b"first", memoryview(first)], cached=True)
            with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                await sender.push(endpoint, [b"owner A", memoryview(region)], cached=True)
            region[:] = 0xBB  # released: owner B writes its bytes there
            receiver.start()
            await sender.push(endpoint, [b"owner B", memoryview(region)], cached=True)
        finally:
            sender.close()

    try:
        asyncio.run(scenario())
        assert wait_for(lambda: len(receiver.got) >= 2, timeout_s=30)
        time.sleep(0.5)  # anything else queued would have arrived by now
        assert receiver.got == [(b"first", {0x11}), (b"owner B", {0xBB})]
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def eric(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    """Short SGLang timeouts and parts sent as bfloat16 (Eric computes float32: each part has a dtype copy), on a
    POOL_BYTES pool that waits 10 s for space."""
    log = tmp_path_factory.mktemp("fences") / "eric.log"
    args = (
        "--sglang-send-timeout",
        "2",
        "--sglang-req-timeout",
        "2",
        "--sglang-dtype",
        "bfloat16",
        "--pool-bytes",
        str(POOL_BYTES),
        "--pool-wait",
        "10",
    )
    with EricServer(qwen2_vl_tiny, log_path=log, extra_args=args) as server:
        yield server


def test_an_encode_slower_than_the_send_timeout_is_not_swept_under_it(eric: EricServer) -> None:
    """Eric's engine and workers are stopped for twice the send timeout while a part encodes: the sweep leaves the
    part alone; when it ends (no rank came: 504), its leases and its bfloat16 copy are given back at once, and the
    same image is encoded again."""
    body = {
        "req_id": f"{uuid.uuid4().hex}_local_part_0",
        "mm_items": [image_data_url(64, 64, seed=5)],
        "num_parts": 1,
        "part_idx": 0,
        "modality": "IMAGE",
    }
    children = psutil.Process(eric.proc.pid).children(recursive=True)
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.update(r=httpx.post(eric.url + "/encode", json=body, timeout=60)))
    for child in children:
        os.kill(child.pid, signal.SIGSTOP)
    try:
        thread.start()
        time.sleep(4.0)  # two send timeouts: the sweep runs every 0.5 s meanwhile
    finally:
        for child in children:
            os.kill(child.pid, signal.SIGCONT)
    thread.join(60)
    assert answer["r"].status_code == 504 and "no prefill rank" in answer["r"].text, answer["r"].text
    held = lambda: held_bytes(eric.url, eric.headers)  # noqa: E731
    assert wait_for(lambda: held() == 0, timeout_s=10), held()
    late = {**body, "req_id": f"{uuid.uuid4().hex}_local_part_0", "mm_items": [image_data_url(64, 64, seed=6)]}
    assert _rank_comes_a_second_after_a_slow_encode(eric, late, children).status_code == 200
    again = {**body, "req_id": f"{uuid.uuid4().hex}_local_part_0"}
    resp = httpx.post(eric.url + "/encode", json=again, timeout=60)
    assert resp.status_code == 504 and "no prefill rank" in resp.text  # encoded, then no rank came again
    assert wait_for(lambda: held_bytes(eric.url, eric.headers) == 0, timeout_s=10)


def _rank_comes_a_second_after_a_slow_encode(eric: EricServer, body: dict, workers: list) -> httpx.Response:
    """The part of `body` encoded while the workers are stopped for two send timeouts, then a pull rank asking for
    it a second after the encode ended (within one send timeout of it: the part must still be there, not swept as
    idle since it was posted). The rank's answer."""
    answer: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: answer.update(r=httpx.post(eric.url + "/encode", json=body, timeout=60)))
    encoded = _encoded_items(eric)
    for child in workers:
        os.kill(child.pid, signal.SIGSTOP)
    try:
        thread.start()
        time.sleep(4.0)
    finally:
        for child in workers:
            os.kill(child.pid, signal.SIGCONT)
    assert wait_for(lambda: _encoded_items(eric) > encoded, timeout_s=30)
    time.sleep(1.0)  # two sweeps: one released the part at once when its idle clock started at the /encode
    meta = {"req_id": body["req_id"], "part_idx": 0}
    rank = httpx.post(eric.url + "/scheduler_receive_meta_data", json=meta, timeout=60)
    thread.join(60)
    assert answer["r"].status_code == 200, answer["r"].text  # the rank's pull answered the /encode's wait
    return rank


def _encoded_items(eric: EricServer) -> float:
    text = httpx.get(eric.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'eric_items_total\{[^}]*source="encoded"[^}]*\} (\S+)', text))


def test_parts_with_dtype_copies_take_turns_instead_of_starving_each_other(eric: EricServer) -> None:
    """Four parts of two images each at once (zmq_to_tokenizer), while the engine is held for 1.5 s: each needs
    2 x 2 KiB of float32 rows and a 2 KiB bfloat16 copy, the pool holds 8 KiB. Every part's copy is reserved with
    its rows, all or none, so the parts take turns and each is delivered (before, two parts filled the pool with
    their rows and waited for copy space only the other could free: every part a 503 after --pool-wait)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    bodies = [
        {
            "req_id": f"{uuid.uuid4().hex}_local_part_0",
            "num_parts": 1,
            "part_idx": 0,
            "modality": "IMAGE",
            "mm_items": [image_data_url(64, 64, seed=300 + 2 * k), image_data_url(64, 64, seed=301 + 2 * k)],
            "prefill_host": "127.0.0.1",
            "embedding_port": port,
        }
        for k in range(4)
    ]
    children = psutil.Process(eric.proc.pid).children(recursive=True)
    try:
        with ThreadPoolExecutor(4) as pool:
            for child in children:  # the engine holds the first encodes: the parts' reservations all overlap
                os.kill(child.pid, signal.SIGSTOP)
            try:
                futures = [pool.submit(httpx.post, eric.url + "/encode", json=b, timeout=60) for b in bodies]
                time.sleep(1.5)
            finally:
                for child in children:
                    os.kill(child.pid, signal.SIGCONT)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
        payloads = []
        for _ in bodies:
            assert sock.poll(10_000), "a delivered part never arrived"
            payloads.append(sock.recv_multipart()[1])
        assert [len(p) for p in payloads] == [IMAGE_ROWS] * 4  # two images' rows in bfloat16: half of 2 x 2 KiB
        assert len({bytes(p) for p in payloads}) == 4  # each part its own images' rows
        held = lambda: held_bytes(eric.url, eric.headers)  # noqa: E731
        assert wait_for(lambda: held() == 0, timeout_s=10), held()
    finally:
        sock.close(linger=0)
        ctx.term()
