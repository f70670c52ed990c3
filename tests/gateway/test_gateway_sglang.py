"""The gateway with --backend sglang: EPD requests go unchanged to the --language-only prefills (SGLang has the
Erics encode them through its own --encoder-urls protocol, tested in test_sglang_adapter.py and, for audio,
test_sglang_audio.py), the rest to plain prefills, each joined to decode by one bootstrap room. Audio parts
(`input_audio`, `audio_url`) count and go as images do; a request with audio and images takes one path.
SGLang's servers are SglangServerStandIn (it cannot run a model here); the gateway and the openai client are real."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import pytest

from eric_epd.stack.process import ServerProcess, free_port
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import audio_bytes, data_url, image_data_url
from eric_epd.testing.stack import ask, gateway_paths, image_messages

IMAGES = [image_data_url(40 + 8 * i, 40, seed=i) for i in range(3)]
CLIPS = [audio_bytes(16000 + 333 * i, 16000, 1, "wav", seed=i) for i in range(2)]


def audio_messages(parts: list[dict], text: str = "What do you hear?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def input_audio(wav: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def audio_url(wav: bytes) -> dict:
    return {"type": "audio_url", "audio_url": {"url": data_url(wav, "audio/wav")}}


class SglangServerStandIn(ServerProcess):
    def __init__(self, name: str, log_path: Path, delay_s: float = 0.0) -> None:
        port = free_port()
        super().__init__(
            [
                sys.executable,
                "-m",
                "eric_epd.testing.sglang_standin",
                "--port",
                str(port),
                "--name",
                name,
                "--delay",
                str(delay_s),
            ],
            port,
            log_path,
            startup_timeout_s=60,
        )

    def requests(self) -> list[dict]:
        return httpx.get(self.url + "/requests").json()

    def fail(self, on: bool) -> None:
        httpx.post(self.url + "/fail", json={"on": on}).raise_for_status()


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("sglang-gw")
    # decode answers after prefill, as it waits for KV; a streamed decode sends its headers at once, before a
    # prefill answers (or fails)
    servers = {
        n: SglangServerStandIn(n, logs / f"{n}.log", delay_s=1.0 if n == "decode" else 0.3).start()
        for n in ("lang_only", "prefill", "decode")
    }
    gateway = GatewayServer(
        logs / "gateway.log",
        "--backend",
        "sglang",
        "--epd-prefill-urls",
        servers["lang_only"].url,
        "--prefill-urls",
        servers["prefill"].url,
        "--decode-urls",
        servers["decode"].url,
        "--sglang-bootstrap-port",
        "8998",
    ).start()
    yield {**servers, "gateway": gateway}
    for server in (gateway, *servers.values()):
        server.stop()


def _last(server: SglangServerStandIn) -> dict:
    return server.requests()[-1]


def test_multi_image_requests_go_to_the_language_only_prefill(sglang) -> None:
    before = gateway_paths(sglang["gateway"])
    answer = ask(sglang["gateway"].url, image_messages(IMAGES))
    assert answer.choices[0].message.content == "answer from decode"
    sent, decoded = _last(sglang["lang_only"]), _last(sglang["decode"])
    assert sent["messages"] == image_messages(IMAGES)  # unchanged: SGLang dispatches the media to the Erics
    assert sent["bootstrap_room"] == decoded["bootstrap_room"] and sent["bootstrap_port"] == 8998
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["stream"] is False
    assert sglang["prefill"].requests() == []
    assert gateway_paths(sglang["gateway"]).get("epd", 0) - before.get("epd", 0) == 1


def test_one_image_and_text_take_the_plain_prefill(sglang) -> None:
    before = gateway_paths(sglang["gateway"])
    for messages in (image_messages(IMAGES[:1]), [{"role": "user", "content": "Hi."}]):
        assert ask(sglang["gateway"].url, messages).choices[0].message.content == "answer from decode"
        assert _last(sglang["prefill"])["messages"] == messages
        assert _last(sglang["prefill"])["bootstrap_room"] == _last(sglang["decode"])["bootstrap_room"]
    assert gateway_paths(sglang["gateway"]).get("pd", 0) - before.get("pd", 0) == 2


def test_failing_language_only_prefill_falls_back_to_plain_prefill(sglang) -> None:
    before = gateway_paths(sglang["gateway"])
    sglang["lang_only"].fail(True)
    try:
        stream = ask(sglang["gateway"].url, image_messages(IMAGES[:2]), stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "answer from decode "
    finally:
        sglang["lang_only"].fail(False)
    assert _last(sglang["prefill"])["messages"] == image_messages(IMAGES[:2])
    after = gateway_paths(sglang["gateway"])
    assert after.get("fallback", 0) - before.get("fallback", 0) == 1
    metrics = httpx.get(sglang["gateway"].url + "/metrics", headers=sglang["gateway"].metrics_headers).text
    assert "gateway_failovers_total" in metrics


def test_unknown_paths_and_methods_get_json_errors(sglang) -> None:
    r = httpx.get(sglang["gateway"].url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(sglang["gateway"].url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_audio_parts_go_to_the_language_only_prefill_as_images_do(sglang) -> None:
    """Two clips (an input_audio and an audio_url part), and a clip with an image: each request goes whole and
    unchanged to the language-only prefill (whose --encoder-urls Erics encode every item), joined to decode; none
    reaches the plain prefill. One clip alone (below --epd-min-items 2) goes to the plain prefill, as one image does."""
    gw = sglang["gateway"].url
    plain_before = len(sglang["prefill"].requests())
    before = gateway_paths(sglang["gateway"])
    image = {"type": "image_url", "image_url": {"url": IMAGES[0]}}
    for parts in ([input_audio(CLIPS[0]), audio_url(CLIPS[1])], [image, input_audio(CLIPS[1])]):
        messages = audio_messages(parts)
        assert ask(gw, messages).choices[0].message.content == "answer from decode"
        sent, decoded = _last(sglang["lang_only"]), _last(sglang["decode"])
        assert sent["messages"] == messages
        assert sent["bootstrap_room"] == decoded["bootstrap_room"] and decoded["messages"] == messages
    assert len(sglang["prefill"].requests()) == plain_before
    after = gateway_paths(sglang["gateway"])
    assert after.get("epd", 0) - before.get("epd", 0) == 2
    one = audio_messages([audio_url(CLIPS[0])])
    assert ask(gw, one).choices[0].message.content == "answer from decode"
    assert _last(sglang["prefill"])["messages"] == one
    assert gateway_paths(sglang["gateway"]).get("pd", 0) - after.get("pd", 0) == 1


def test_failing_language_only_prefill_sends_audio_and_image_whole_to_the_plain_prefill(sglang) -> None:
    """A clip and an image whose language-only prefill fails: both go, as the client sent them, to the plain
    prefill (SGLang's own encoder path), never split between the two."""
    gw = sglang["gateway"].url
    before = gateway_paths(sglang["gateway"])
    messages = audio_messages([input_audio(CLIPS[0]), {"type": "image_url", "image_url": {"url": IMAGES[1]}}])
    sglang["lang_only"].fail(True)
    try:
        assert ask(gw, messages).choices[0].message.content == "answer from decode"
    finally:
        sglang["lang_only"].fail(False)
    assert _last(sglang["lang_only"])["messages"] == messages
    assert _last(sglang["prefill"])["messages"] == messages
    assert gateway_paths(sglang["gateway"]).get("fallback", 0) - before.get("fallback", 0) == 1
