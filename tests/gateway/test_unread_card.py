"""An Eric whose model card cannot be read, in front of real vLLM: the gateway fetches each image once and inlines it
before encoding, so the engine answers on the bytes Eric encoded, even from an origin that answers every fetch of
the same URL with another image."""

from __future__ import annotations

import base64
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_data_url
from eric_epd.testing.pools import held_bytes
from eric_epd.testing.stack import ask_greedy, image_messages, metric, wait_for
from eric_epd.testing.standins import ProxyEric

API_KEY = "sk-unread-card"
IMAGES = 3


def version(n: int, k: int) -> str:
    """Image `n` as the origin answers its `k`-th fetch (a data URL of the same PNG)."""
    return image_data_url(56 + 8 * n, 64, seed=700 + 10 * k + n)


class _Changing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server: ChangingOrigin = self.server  # type: ignore[assignment]
        n = int(self.path.strip("/").split(".")[0])
        with server.lock:
            k = server.hits[n]
            server.hits[n] += 1
        body = base64.b64decode(version(n, k).split(",", 1)[1])
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


class ChangingOrigin(ThreadingHTTPServer):
    """A media origin on loopback whose `/N.png` is another image at every fetch; `hits` counts the fetches."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Changing)
        self.hits: Counter[int] = Counter()
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def world(vllm_behind_erics, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The gateway's one Eric behind a proxy whose /v1/models fails; the origin allowed to the gateway only."""
    erics, vllm, key = vllm_behind_erics["erics"], vllm_behind_erics["vllm"], vllm_behind_erics["eric_key"]
    origin = ChangingOrigin()
    with ProxyEric(erics[0].url, card=False) as proxy:
        gateway = GatewayServer(
            tmp_path_factory.mktemp("unread-card") / "gateway.log",
            "--encoder-urls",
            proxy.url,
            "--colocated-urls",
            vllm.url,
            api_key=API_KEY,
            eric_api_key=key,
            upstream_api_key=vllm.api_key,
            media_hosts=("127.0.0.1",),
        ).start()
        try:
            yield {"gateway": gateway, "proxy": proxy, "origin": origin, "eric": erics[0], "vllm": vllm}
        finally:
            gateway.stop()
            origin.shutdown()


def test_an_unread_card_still_encodes_the_bytes_the_engine_sees(world) -> None:
    """Three images by URL go EPD although the card is never read: one fetch each (the gateway's), Eric encodes
    what the gateway fetched, and the answer is vLLM's own for those bytes (the first version of each image);
    against the second versions, which Eric would have fetched had the gateway sent the URLs on, it fails. Asked
    again, the same URLs give the second versions' answer, and nothing stays held."""
    gateway, proxy, origin, eric, vllm = (world[k] for k in ("gateway", "proxy", "origin", "eric", "vllm"))
    encoded = metric(eric.url, "eric_items_total", eric.headers)
    answer = ask_greedy(gateway.url, image_messages([f"{origin.url}/{n}.png" for n in range(IMAGES)]), key=API_KEY)
    assert proxy.asked["/v1/models"] >= 1 and proxy.received == IMAGES  # the card was asked for, and failed
    assert origin.hits == Counter(dict.fromkeys(range(IMAGES), 1))  # one fetch per item, shared by Eric and vLLM
    assert metric(eric.url, "eric_items_total", eric.headers) == encoded + IMAGES  # the EPD path, Eric's rows
    first = ask_greedy(vllm.url, image_messages([version(n, 0) for n in range(IMAGES)]), key=vllm.api_key)
    assert_greedy_agree(answer, first, NEAR_TIE_FLOAT32, "EPD with the card unread")
    second = ask_greedy(vllm.url, image_messages([version(n, 1) for n in range(IMAGES)]), key=vllm.api_key)
    # the negative control: other bytes (the origin's second versions, same sizes) give another answer
    assert_greedy_differ(answer, second, NEAR_TIE_FLOAT32, "EPD with the card unread, against other bytes")
    again = ask_greedy(gateway.url, image_messages([f"{origin.url}/{n}.png" for n in range(IMAGES)]), key=API_KEY)
    assert origin.hits == Counter(dict.fromkeys(range(IMAGES), 2))  # fetched once more: now the second versions
    assert_greedy_agree(again, second, NEAR_TIE_FLOAT32, "the same URLs again, the origin's new bytes")
    held = lambda: held_bytes(eric.url, eric.headers)  # noqa: E731
    assert wait_for(lambda: held() == 0), held()  # every lease of both requests ended
