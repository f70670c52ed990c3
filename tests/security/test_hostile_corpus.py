"""A hostile media corpus against real servers at once: the gateway (its own resolver pointed at a nameserver that
never answers, in a mount namespace of its own), Eric with an audio model and vLLM behind them. Compression bombs,
stacked encodings, JSON amplification, a 60 KB URL, a slow origin, a name that never resolves, playlists and stills
sent as audio or video: each is a 4xx naming its problem within its bound. Clips at odd sample rates are encoded.
A good request sent beside them is answered, every server's memory stays bounded, and every server is healthy
after."""

from __future__ import annotations

import base64
import functools
import gzip
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest

from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import audio_bytes, data_url, image_data_url

BOMB_BYTES = 512 << 20
FETCH_TIMEOUT_S = 3
RSS_GROWTH = {"gateway": 400 << 20, "eric": 800 << 20, "vllm": 800 << 20}
"""The most each server's resident memory (all its processes) may grow over the whole corpus."""


@functools.cache
def _bomb() -> bytes:
    """BOMB_BYTES of zeros, gzipped (about 500 KiB)."""
    return gzip.compress(bytes(BOMB_BYTES), 9)


@functools.cache
def _double() -> bytes:
    return gzip.compress(gzip.compress(bytes(64 << 20), 9), 9)


class _Origin(BaseHTTPRequestHandler):
    """/bomb.wav, /double.wav (gzip), /hang.wav (never answers within the fetch timeout)."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/hang.wav":
            self.release.wait(FETCH_TIMEOUT_S * 10)
            return
        body, coding = {"/bomb.wav": (_bomb(), "gzip"), "/double.wav": (_double(), "gzip, gzip")}[self.path]
        self.send_response(200)
        self.send_header("Content-Encoding", coding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """The fetchers hang up on the bombs by design."""


def _black_hole() -> socket.socket:
    """A 'nameserver' on 127.0.0.99:53 that reads every query and answers none."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.99", 53))

    def drain() -> None:
        while True:
            try:
                sock.recv(4096)
            except OSError:
                return

    threading.Thread(target=drain, daemon=True).start()
    return sock


@pytest.fixture(scope="module")
def world(qwen2_audio_servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("hostile")
    _bomb(), _double()  # built before any fetch waits on them (a 3 s fetch timeout is shorter than gzip -9 of 512 MiB)
    origin = _Quiet(("127.0.0.1", 0), _Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    hole = _black_hole()
    resolv = tmp / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.99\noptions timeout:1 attempts:1\n")
    own_resolver = ("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv))
    eric, vllm = qwen2_audio_servers["eric"], qwen2_audio_servers["vllm"]
    gateway = GatewayServer(
        tmp / "gateway.log",
        "--encoder-urls",
        eric.url,
        "--colocated-urls",
        vllm.url,
        "--media-fetch-timeout",
        str(FETCH_TIMEOUT_S),
        eric_api_key=eric.api_key,
        upstream_api_key=vllm.api_key,
        media_hosts=("127.0.0.1",),
        wrap=own_resolver,
    )
    with gateway:
        yield {"gateway": gateway, "eric": eric, "vllm": vllm, "origin": f"http://127.0.0.1:{origin.server_address[1]}"}
    _Origin.release.set()
    origin.shutdown()
    hole.close()


def _audio(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def _clip(rate: int, seconds: float = 1.0, seed: int = 0) -> dict:
    wav = audio_bytes(int(rate * seconds), rate, 1, "wav", seed=seed)
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def _chat(*parts: dict, model: str = "m") -> dict:
    return {
        "model": model,
        "max_tokens": 2,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What do you hear?"}]}],
    }


def _corpus(origin: str) -> dict[str, tuple[bytes | dict, set[int], str]]:
    """name -> (body, statuses allowed, words the error message must hold)."""
    concat = b"ffconcat version 1.0\nfile secret.wav\n"
    hls = b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
    amplified = (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": [' + b"[]," * (8 << 20) + b"[]]}"
    )
    return {
        "gzip bomb": (_chat(_audio(f"{origin}/bomb.wav")), {413}, "size limit"),
        "stacked encodings": (_chat(_audio(f"{origin}/double.wav")), {400}, "content encodings"),
        "slow origin": (_chat(_audio(f"{origin}/hang.wav")), {408}, "timed out"),
        "name that never resolves": (
            _chat(_audio("http://never-answers.example/a.wav")),
            {400, 408},
            "never-answers.example",
        ),
        "JSON amplification": (amplified, {400}, "tokens"),
        "60 KB URL": (_chat(_audio("http://example.com/" + "a" * 60_000)), {400}, "8192"),
        "ffconcat as audio": (_chat(_audio(data_url(concat, "audio/wav")), _clip(16000)), {400}, "content[0]"),
        "HLS as audio": (_chat(_audio(data_url(hls, "audio/wav"))), {400}, "content[0]"),
        "still image as audio": (_chat(_audio(image_data_url(32, 32))), {400}, "content[0]"),
    }


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in (root, *root.children(recursive=True)))


def _post(gateway: GatewayServer, body: bytes | dict) -> httpx.Response:
    url = gateway.url + "/v1/chat/completions"
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    return httpx.post(url, json=body, timeout=120)


def test_every_hostile_request_is_a_4xx_and_a_good_one_beside_them_is_answered(world) -> None:
    gateway = world["gateway"]
    servers = {name: world[name] for name in ("gateway", "eric", "vllm")}
    model = httpx.get(gateway.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    before = {name: _rss(server) for name, server in servers.items()}
    corpus = _corpus(world["origin"])
    odd_rates = {
        rate: _chat(_clip(rate, seed=rate), _clip(rate, 0.5, seed=rate + 1), model=model)
        for rate in (4001, 44101, 191999)
    }  # two clips: the EPD path, resampled in Eric
    good = _chat(_clip(16000, seed=1), _clip(16000, 0.75, seed=2), model=model)
    with ThreadPoolExecutor(len(corpus) + len(odd_rates) + 1) as pool:
        hostile = {name: pool.submit(_post, gateway, body) for name, (body, _, _) in corpus.items()}
        odd = {rate: pool.submit(_post, gateway, body) for rate, body in odd_rates.items()}
        answer = pool.submit(_post, gateway, good).result()
        results = {name: future.result() for name, future in hostile.items()}
        odd_results = {rate: future.result() for rate, future in odd.items()}
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["usage"]["completion_tokens"] == 2
    for name, resp in results.items():
        _, statuses, words = corpus[name]
        assert resp.status_code in statuses, (name, resp.status_code, resp.text[:300])
        assert words in resp.json()["error"]["message"], (name, resp.text[:300])
    for rate, resp in odd_results.items():
        assert resp.status_code == 200, (rate, resp.text[:300])
        assert resp.headers["x-epd-path"] == "epd", rate
    grown = {name: _rss(server) - before[name] for name, server in servers.items()}
    assert all(grown[name] < RSS_GROWTH[name] for name in servers), grown
    for name, server in servers.items():
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200, name
    assert _post(gateway, good).status_code == 200  # and it goes on serving


def test_the_bomb_would_cost_what_it_claims(world) -> None:
    """Negative control for the memory bound: inflated without a bound, one bomb is 512 MiB."""
    import zlib

    assert len(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(_bomb())) == BOMB_BYTES
    assert Path("/etc/resolv.conf").read_text() != "nameserver 127.0.0.99\n"  # only the gateway sees the black hole
