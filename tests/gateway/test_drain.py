"""Draining loses nothing, against real Erics, vLLM and the gateway: SIGTERM to one of two Erics under load (chats
streamed and not) and every chat answers with no fallback; the draining Eric refuses new encodes with a 503 and
Retry-After (the gateway places them on the other, counting no failure), is alive but not ready, still serves the read
and the ack of a lease it handed out before, and exits 0 as soon as none is left, well before its drain timeout."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe
from eric_epd.testing.exactness import Greedy
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import ask_greedy, gateway_paths, image_messages, metric, wait_for
from eric_epd.wire.eric import decode_answer
from eric_epd.wire.handles import LEASE_HEADER, ack_request

API_KEY = "sk-drain"
DRAIN_S = 60.0
"""The draining Eric's --drain-timeout: it must exit long before (as soon as its last lease ends)."""
CHATS = 24
"""Chats sent, one every PACE_S, three fresh images each (so both Erics get items all along)."""
PACE_S = 0.25


def _encode(eric: EricServer, seed: int) -> httpx.Response:
    return httpx.post(
        eric.url + "/v1/encode",
        headers=eric.headers,
        timeout=60,
        json={"items": [{"modality": "image", "url": image_data_url(72, 64, seed=seed)}]},
    )


def _refused(eric: EricServer, seed: int) -> bool:
    """Whether an encode is refused; one answered (sent before the signal took effect) has its lease acked."""
    answer = _encode(eric, seed)
    if answer.status_code == 200:
        for item in decode_answer(answer.content).items:
            ack = ack_request(eric.url, item.hash, item.handle.lease, item.handle.instance_id)
            httpx.post(ack.url, headers={**eric.headers, **ack.headers}, content=ack.content)
    return answer.status_code == 503


def test_sigterm_under_load_loses_no_request(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    key = new_key()
    first = EricServer(
        qwen2_vl_tiny, api_key=key, log_path=tmp_path / "eric1.log", extra_args=("--drain-timeout", str(DRAIN_S))
    )
    second = EricServer(qwen2_vl_tiny, api_key=key, log_path=tmp_path / "eric2.log")
    vllm = VllmServe(qwen2_vl_tiny, tmp_path / "vllm.log", eric_urls=[first.url, second.url], eric_api_key=key)
    futures: list[Future[Greedy]] = []

    def one(i: int) -> Greedy:
        images = [image_data_url(56 + 8 * j, 64, seed=7000 + 10 * i + j) for j in range(3)]
        return ask_greedy(gw.url, image_messages(images), key=API_KEY, stream=i % 2 == 1)

    def send(pool: ThreadPoolExecutor) -> None:
        start = time.monotonic()
        while len(futures) < CHATS:
            time.sleep(max(0.0, start + len(futures) * PACE_S - time.monotonic()))  # open loop
            futures.append(pool.submit(one, len(futures)))

    with running(first, second, vllm):
        gw = GatewayServer(
            tmp_path / "gateway.log",
            "--encoder-urls",
            f"{first.url},{second.url}",
            "--colocated-urls",
            vllm.url,
            api_key=API_KEY,
            eric_api_key=key,
            upstream_api_key=vllm.api_key,
        )
        with gw, ThreadPoolExecutor(6) as pool:
            held = _encode(first, 1)  # a lease a consumer still holds when the SIGTERM comes
            assert held.status_code == 200, held.text
            (item,) = decode_answer(held.content).items
            sender = threading.Thread(target=send, args=(pool,), daemon=True)
            sender.start()
            assert wait_for(lambda: sum(f.done() for f in list(futures)) >= 6, 180)
            assert metric(first.url, "eric_items_total") > 1  # the load reaches the Eric that drains
            pool = httpx.get(first.url + "/v1/transfer", headers=first.headers).json()["pool_name"]
            assert Path(f"/dev/shm/{pool}").exists()
            first.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert wait_for(lambda: _refused(first, 2), 10), "still admitting after SIGTERM"
            refused = _encode(first, 3)
            assert "draining" in refused.json()["error"]["message"] and "retry-after" in refused.headers
            assert httpx.get(first.url + "/health").status_code == 200
            assert httpx.get(first.url + "/ready").json()["reason"].startswith("draining")
            lease = {**first.headers, LEASE_HEADER: item.handle.lease}
            read = httpx.get(f"{first.url}/v1/embeddings/{item.hash}", headers=lease)
            assert read.status_code == 200 and len(read.content) > 4 * item.shape[0] * item.shape[1], read.text
            sender.join()
            results = [f.result(timeout=300) for f in futures]  # every chat answered, none raised
            assert first.proc.poll() is None  # the held lease keeps it serving
            # the draining Eric's refusals moved items to the other, counted as no failure (no ejection)
            assert metric(gw.url, 'gateway_failures_total{stage="encode"}', gw.metrics_headers) == 0
            assert metric(gw.url, "gateway_failovers_total", gw.metrics_headers) > 0
            ack = ack_request(first.url, item.hash, item.handle.lease, item.handle.instance_id)
            assert httpx.post(ack.url, headers={**first.headers, **ack.headers}, content=ack.content).status_code == 200
            assert first.proc.wait(DRAIN_S / 2) == 0
            assert time.monotonic() - signalled < DRAIN_S / 2
            log = (tmp_path / "eric1.log").read_text()
            assert "drained: every lease handed out has ended" in log, log[-2000:]
            assert not Path(f"/dev/shm/{pool}").exists()  # the pool went with it: the shutdown ran to its end
            paths = gateway_paths(gw)
            assert paths.get("epd") == CHATS and not paths.get("fallback"), paths
            assert all(len(r.tokens) == 10 for r in results)
