"""No engine fetches what a client named: URL tricks (parser differentials, numeric and IPv6 forms, userinfo,
redirects) aimed at internal listeners, sent on every path of real gateways over real Erics and a real vLLM, each
get a 4xx and the listeners see no connection; good remote media reach vLLM only as bytes the gateway fetched."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from eric_epd.stack.process import free_port
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import image_bytes, image_data_url, random_image
from eric_epd.testing.stack import image_messages

GOOD_PNG = image_bytes(random_image(64, 48, seed=900))
OTHER = image_data_url(56, 56, seed=901)
GATEWAY_AGENT = "eric-epd-media/0.1"


class Listener:
    """An internal service (a TCP port on a non-allowlisted loopback address) that counts connections."""

    def __init__(self, family: socket.AddressFamily, host: str) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


class _Media(BaseHTTPRequestHandler):
    """A media origin the operator allows (127.0.0.1): /good.png, and /to/<i> redirecting to the i-th target."""

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, MediaOrigin)
        server.agents.append((self.path, self.headers.get("user-agent", "")))
        if self.path == "/good.png":
            self.send_response(200)
            self.send_header("content-length", str(len(GOOD_PNG)))
            self.end_headers()
            self.wfile.write(GOOD_PNG)
            return
        index = int(self.path.removeprefix("/to/")) if self.path.startswith("/to/") else -1
        if 0 <= index < len(server.targets):
            self.send_response(302)
            self.send_header("location", server.targets[index])
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_error(404)

    def log_message(self, *_: object) -> None:
        pass


LOOPBACK = ("127.0.0.1",)
"""The media origin's address, let past the gateways' URL policy (the tricks aim elsewhere on loopback)."""


class MediaOrigin(ThreadingHTTPServer):
    def __init__(self, targets: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Media)
        self.targets = targets
        self.agents: list[tuple[str, str]] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def tricks(v4: int, v6: int, origin: MediaOrigin) -> list[str]:
    """URLs that reach 127.0.0.3:v4 or [::1]:v6 if any parser, resolver or redirect on the way is fooled."""
    parser_differentials = [
        f"http://127.0.0.1\\@127.0.0.3:{v4}/a.png",
        f"http://127.0.0.3:{v4}\\@127.0.0.1/a.png",
        f"http://127.0.0.1:80#@127.0.0.3:{v4}/a.png",
        f"http://127.0.0.1%2f@127.0.0.3:{v4}/a.png",
        f"http:/\\127.0.0.3:{v4}/a.png",
        f"http:\\\\127.0.0.3:{v4}/a.png",
        f"http:///127.0.0.3:{v4}/a.png",
        f"http://127.0.0.3:{v4} /a.png",
        f"http://127.0.0.1\t@127.0.0.3:{v4}/",
        f"http://127.0.0.3:{v4}\n/a.png",
        f"http://127.0.0.3%3a{v4}/a.png",
        f"http://127%2e0.0.3:{v4}/a.png",
        f"http://127。0。0。3:{v4}/a.png",
    ]
    numeric = [
        f"http://2130706435:{v4}/a.png",
        f"http://0x7f000003:{v4}/a.png",
        f"http://0x7f.0.0.3:{v4}/a.png",
        f"http://0177.0.0.3:{v4}/a.png",
        f"http://127.3:{v4}/a.png",
        f"http://127.0.0.3.:{v4}/a.png",
        f"http://127.0.0.3:{v4}/a.png",
        f"HTTP://127.0.0.3:{v4}/a.png",
    ]
    ipv6 = [
        f"http://[::1]:{v6}/a.png",
        f"http://[0:0:0:0:0:0:0:1]:{v6}/a.png",
        f"http://[::ffff:127.0.0.3]:{v4}/a.png",
        f"http://[::ffff:7f00:3]:{v4}/a.png",
        f"http://[::127.0.0.3]:{v4}/a.png",
        f"http://[64:ff9b::7f00:3]:{v4}/",
        f"http://[2002:7f00:3::]:{v4}/a.png",
        f"http://[::1%25lo]:{v6}/a.png",
        f"http://[::1]x:{v6}/a.png",
    ]
    userinfo = [
        f"http://user:pw@127.0.0.3:{v4}/a.png",
        f"http://127.0.0.1@127.0.0.3:{v4}/a.png",
        f"http://127.0.0.1:{origin.server_address[1]}@127.0.0.3:{v4}/a.png",
    ]
    names = [f"http://localhost:{v6}/a.png", f"http://ip6-localhost:{v6}/a.png"]
    origin.targets[:] = [
        f"http://127.0.0.3:{v4}/a.png",
        f"http://[::1]:{v6}/a.png",
        f"http://localhost:{v6}/a",
        f"http://2130706435:{v4}/a.png",
        f"http://127.0.0.1\\@127.0.0.3:{v4}/",
        "file:///etc/passwd",
        f"{origin.url}/to/6",
    ]
    redirects = [f"{origin.url}/to/{i}" for i in range(len(origin.targets))]
    return parser_differentials + numeric + ipv6 + userinfo + names + redirects


@pytest.fixture(scope="module")
def world(vllm_behind_erics, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Internal listeners, an allowed media origin, and a gateway per path: vLLM with its Erics (PD for one item,
    EPD for two), vLLM whose Eric is down (fallback), and SGLang's backend (its upstreams are never reached)."""
    logs = tmp_path_factory.mktemp("url-tricks")
    erics, vllm = vllm_behind_erics["erics"], vllm_behind_erics["vllm"]
    keys = {"eric_api_key": vllm_behind_erics["eric_key"], "upstream_api_key": vllm.api_key}
    v4, v6 = Listener(socket.AF_INET, "127.0.0.3"), Listener(socket.AF_INET6, "::1")
    origin = MediaOrigin([])
    dead = f"http://127.0.0.1:{free_port()}"
    gateways = {
        "epd": GatewayServer(
            logs / "epd.log",
            "--encoder-urls",
            ",".join(e.url for e in erics),
            "--colocated-urls",
            vllm.url,
            media_hosts=LOOPBACK,
            **keys,
        ).start(),
        "fallback": GatewayServer(
            logs / "fallback.log", "--encoder-urls", dead, "--colocated-urls", vllm.url, media_hosts=LOOPBACK, **keys
        ).start(),
        "sglang": GatewayServer(
            logs / "sglang.log",
            "--backend",
            "sglang",
            "--prefill-urls",
            dead,
            "--decode-urls",
            dead,
            "--epd-prefill-urls",
            dead,
            media_hosts=LOOPBACK,
        ).start(),
    }
    model = httpx.get(vllm.url + "/v1/models", headers=vllm.headers).json()["data"][0]["id"]
    yield {"v4": v4, "v6": v6, "origin": origin, "vllm": vllm, "model": model, **gateways}
    for gateway in gateways.values():
        gateway.stop()
    origin.shutdown()


def _chat(gateway: GatewayServer, urls: list[str], model: str) -> httpx.Response:
    body = {"model": model, "max_tokens": 2, "messages": image_messages(urls)}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)


def test_url_tricks_refused_on_every_path_and_never_reach_the_listener(world) -> None:
    urls = tricks(world["v4"].port, world["v6"].port, world["origin"])
    paths = {
        "pd": (world["epd"], 1),
        "epd": (world["epd"], 2),
        "fallback": (world["fallback"], 2),
        "sglang-pd": (world["sglang"], 1),
        "sglang-epd": (world["sglang"], 2),
    }
    answers = {}
    for name, (gateway, items) in paths.items():
        for url in urls:
            resp = _chat(gateway, [url, OTHER][:items], world["model"])
            answers[name, url] = (resp.status_code, resp.json().get("error", {}).get("message"))
    wrong = {key: answer for key, answer in answers.items() if not 400 <= answer[0] < 500 or not answer[1]}
    assert not wrong, wrong  # each a 4xx in the error shape, naming the problem
    assert world["v4"].connections == 0 and world["v6"].connections == 0
    # the origin answered only the gateway's own fetcher (redirect hops), never an engine
    assert {agent for _, agent in world["origin"].agents} == {GATEWAY_AGENT}


def test_remote_media_reach_the_engines_as_bytes(world) -> None:
    """vLLM runs with --allowed-media-domains set to a name that cannot resolve and redirects off: an http URL that
    reached it would be refused; through the gateway, an allowed origin's image is served on the PD and fallback
    paths, fetched once per request, by the gateway."""
    origin, good = world["origin"], f"{world['origin'].url}/good.png"
    before = len(origin.agents)
    for gateway, items in ((world["epd"], 1), (world["fallback"], 2)):
        resp = _chat(gateway, [good, OTHER][:items], world["model"])
        assert resp.status_code == 200, resp.text[:300]
        assert resp.headers["x-epd-path"] == ("pd" if items == 1 else "fallback")
    fetched = origin.agents[before:]
    assert fetched == [("/good.png", GATEWAY_AGENT)] * 2


def test_vllm_itself_fetches_no_url(world) -> None:
    """The second wall: vLLM, asked directly with its own key, refuses http URLs (allowed or internal) and file
    URLs, and reaches nobody."""
    vllm, model, before = world["vllm"], world["model"], len(world["origin"].agents)

    def ask(url: str) -> httpx.Response:
        body = {"model": model, "max_tokens": 2, "messages": image_messages([url])}
        return httpx.post(vllm.url + "/v1/chat/completions", json=body, headers=vllm.headers, timeout=120)

    for url in (
        f"{world['origin'].url}/good.png",
        f"http://127.0.0.3:{world['v4'].port}/a.png",
        f"{world['origin'].url}/to/0",
    ):
        resp = ask(url)
        assert resp.status_code == 400 and "allowed domains" in resp.json()["error"]["message"], resp.text[:300]
    resp = ask("file:///etc/hostname")  # vLLM answers this refusal with a 500
    assert resp.status_code >= 400 and "allowed-local-media-path" in resp.json()["error"]["message"], resp.text
    assert len(world["origin"].agents) == before and world["v4"].connections == 0
