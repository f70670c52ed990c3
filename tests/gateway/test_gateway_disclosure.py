"""What a real gateway gives away, asked as a stranger would: /health says only up or down, an upstream's failure
names no internal address, and each upstream receives exactly its own key (recording stand-ins for the upstreams)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from eric_epd.stack.process import free_port
from eric_epd.stack.servers import GatewayServer

ERIC_KEY, API_KEY, ADMIN_KEY = "eric-secret-key", "sk-client", "admin-secret"


class Recorder(ThreadingHTTPServer):
    """A stand-in upstream that records each request's Authorization header and answers 500 with an internal
    address in its text (as an engine's failure might)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Record)
        self.auth: list[tuple[str, str | None]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Record(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server = self.server
        assert isinstance(server, Recorder)
        server.auth.append((self.path, self.headers.get("authorization")))
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = b'{"error": {"message": "peer 10.1.2.3:5600 (http://kv-peer.internal:7000) refused"}}'
        self.send_response(500)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.do_POST()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("disclosure")
    text, geri, engine = Recorder(), Recorder(), Recorder()
    dead = f"http://127.0.0.1:{free_port()}"
    images = GatewayServer(
        logs / "images.log",
        "--text-encoder-urls",
        text.url,
        "--geri-urls",
        geri.url,
        "--encoder-urls",
        dead,
        "--colocated-urls",
        engine.url,
        eric_api_key=ERIC_KEY,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
    ).start()
    down = GatewayServer(
        logs / "down.log", "--colocated-urls", dead, "--encoder-urls", dead, eric_api_key=ERIC_KEY
    ).start()
    yield {"images": images, "down": down, "text": text, "geri": geri, "engine": engine, "dead": dead}
    for server in (images, down):
        server.stop()
    for recorder in (text, geri, engine):
        recorder.shutdown()


def test_health_tells_strangers_only_up_or_down(gateways) -> None:
    gw = gateways["images"]
    assert httpx.get(gw.url + "/health").json() == {"status": "ok"}
    assert httpx.get(gw.url + "/health", headers={"Authorization": "Bearer wrong"}).json() == {"status": "ok"}
    for key in (API_KEY, ADMIN_KEY):
        detailed = httpx.get(gw.url + "/health", headers={"Authorization": f"Bearer {key}"}).json()
        assert set(detailed["encoders"]) == {gateways["dead"]}
    assert httpx.get(gateways["down"].url + "/health").json() == {"status": "ok"}  # no key configured: none shown


def test_each_upstream_gets_only_its_own_key(gateways) -> None:
    """No text-encoder or Geri key is configured: they get no Authorization at all (not the Erics' key)."""
    gw = gateways["images"]
    resp = httpx.post(
        gw.url + "/v1/images/generations", json={"prompt": "a cat", "size": "64x64"}, headers=gw.headers, timeout=60
    )
    assert resp.status_code >= 500
    assert gateways["text"].auth and all(auth is None for _, auth in gateways["text"].auth)
    resp = httpx.post(
        gw.url + "/v1/chat/completions",
        headers=gw.headers,
        timeout=60,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 500 and gateways["engine"].auth[-1][1] is None  # no --upstream-api-key either
    assert ERIC_KEY not in str(gateways["engine"].auth + gateways["text"].auth)


def test_failures_name_no_internal_address(gateways) -> None:
    dead_port = gateways["dead"].rsplit(":", 1)[1]
    answers = [
        httpx.post(
            gateways["down"].url + "/v1/chat/completions",
            timeout=60,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
        httpx.get(gateways["down"].url + "/v1/models", timeout=60),
        httpx.post(
            gateways["images"].url + "/v1/images/generations",
            json={"prompt": "a cat", "size": "64x64"},
            headers=gateways["images"].headers,
            timeout=60,
        ),
        httpx.post(
            gateways["images"].url + "/v1/chat/completions",
            headers=gateways["images"].headers,
            timeout=60,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ]
    for resp in answers:
        assert resp.status_code >= 500, resp.text
        text = resp.text
        for secret in ("127.0.0.1", f":{dead_port}", "10.1.2.3", "kv-peer.internal", "5600"):
            assert secret not in text, (secret, text)
        assert resp.json()["error"]  # still the error shape, with what could be said
