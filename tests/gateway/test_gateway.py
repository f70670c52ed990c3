"""The gateway in front of real Erics and a real vLLM (with the Eric connector), queried with the openai client."""

from __future__ import annotations

import base64
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from eric_epd.common.registration import signed_registration
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import ask as _ask
from eric_epd.testing.stack import ask_greedy, gateway_paths, image_messages
from tests.support.placement import sets_placed_on

API_KEY = "sk-test"
KEYED = {"Authorization": f"Bearer {API_KEY}"}
"""What /health wants before it names the encoders."""


@pytest.fixture(scope="module")
def stack(vllm_behind_erics, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("stack")
    erics, vllm = vllm_behind_erics["erics"], vllm_behind_erics["vllm"]
    gateway = GatewayServer(
        logs / "gateway.log",
        "--encoder-urls",
        ",".join(e.url for e in erics),
        "--colocated-urls",
        vllm.url,
        "--api-key",
        API_KEY,
        "--max-items",
        "4",
        "--register-from",
        "127.0.0.0/8",
        admin_key="admin-test",
        eric_api_key=vllm_behind_erics["eric_key"],
        upstream_api_key=vllm.api_key,
    ).start()
    yield {"erics": erics, "vllm": vllm, "gateway": gateway, "eric_key": vllm_behind_erics["eric_key"]}
    gateway.stop()


def ask(base_url: str, msgs: list[dict], key: str = API_KEY, **kw):
    return _ask(base_url, msgs, key=key, **kw)


def direct(stack, msgs: list[dict], **kw):
    """vLLM asked directly (its own encoder on the raw media), with its own key."""
    return _ask(stack["vllm"].url, msgs, key=stack["vllm"].api_key, **kw)


IMAGES = [image_data_url(64 + 24 * i, 72, seed=300 + i) for i in range(3)]
OTHER_IMAGES = [image_data_url(64 + 24 * i, 72, seed=400 + i) for i in range(3)]
"""IMAGES' sizes, other pixels: the negative control's wrong input."""


def test_epd_answer_equals_monolithic_and_streams(stack) -> None:
    """Token-exact with vLLM's own encoder up to the first near tie (two towers' float sums); streamed, the
    non-streamed EPD answer up to the first near tie (vLLM's prefix cache computes a repeated prompt's tail alone)."""
    gw = stack["gateway"].url
    mono = direct(stack, image_messages(IMAGES))  # vLLM's own encoder on the raw images
    via = ask(gw, image_messages(IMAGES))
    assert via.usage.prompt_tokens == mono.usage.prompt_tokens
    ours = ask_greedy(gw, image_messages(IMAGES), key=API_KEY)
    vllm_url, vllm_key = stack["vllm"].url, stack["vllm"].api_key
    assert_greedy_agree(ours, ask_greedy(vllm_url, image_messages(IMAGES), key=vllm_key), NEAR_TIE_FLOAT32, "EPD")
    wrong = ask_greedy(vllm_url, image_messages(OTHER_IMAGES), key=vllm_key)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "EPD against other images' answer")
    reordered = image_messages([*IMAGES[1:], IMAGES[0]])
    streamed = ask_greedy(gw, reordered, key=API_KEY, stream=True)
    assert len(streamed.tokens) == 10
    assert_greedy_agree(streamed, ask_greedy(gw, reordered, key=API_KEY), NEAR_TIE_FLOAT32, "streamed")


def test_paths_by_number_of_images(stack) -> None:
    gw = stack["gateway"]
    before = gateway_paths(gw)
    text_only = [{"role": "user", "content": "Hello there."}]
    assert ask(gw.url, text_only).choices[0].message.content
    assert ask(gw.url, image_messages(IMAGES[:1])).choices[0].message.content
    assert ask(gw.url, image_messages(IMAGES[1:])).choices[0].message.content
    # the image the plain path carried does not count again (vLLM holds it): with one new image, still plain
    assert ask(gw.url, image_messages(IMAGES[:2])).choices[0].message.content
    after = gateway_paths(gw)
    assert after.get("pd", 0) - before.get("pd", 0) == 3
    assert after.get("epd", 0) - before.get("epd", 0) == 1


def test_completions_equal_vllm_streamed_and_not(stack) -> None:
    """/v1/completions (text prompts) passes through on the PD path, streaming or not."""
    import openai

    def complete(url: str, key: str, **kw):
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        return client.completions.create(
            model=client.models.list().data[0].id,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            **kw,
        )

    gw = stack["gateway"].url
    before = gateway_paths(stack["gateway"])
    mono = complete(stack["vllm"].url, stack["vllm"].api_key)
    via = complete(gw, API_KEY)
    assert via.choices[0].text == mono.choices[0].text and via.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in complete(gw, API_KEY, stream=True) if c.choices)
    assert streamed == mono.choices[0].text
    assert gateway_paths(stack["gateway"]).get("pd", 0) - before.get("pd", 0) == 2
    with pytest.raises(openai.AuthenticationError):
        complete(gw, "wrong")


def test_bad_requests_shaped_like_vllm(stack) -> None:
    url = stack["gateway"].url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url, content=b'{"model": "m", "messages": [', headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m", "messages": image_messages(IMAGES + IMAGES)}, headers=auth)
    assert r.status_code == 400 and "too many media items" in r.json()["error"]["message"]
    bad_part = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]}]
    r = httpx.post(url, json={"model": "m", "messages": bad_part}, headers=auth)
    assert r.status_code == 400 and "unsupported content part type 'file'" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "m", "messages": image_messages(["http://10.0.0.1/a.png"])}, headers=auth)
    assert r.status_code == 400 and "private" in r.json()["error"]["message"]
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    fresh = [image_data_url(64, 64 + 8 * k, seed=2500 + k) for k in range(2)]  # new: the request goes EPD
    r = httpx.post(url, json={"model": "m", "messages": image_messages([*fresh, not_an_image])}, headers=auth)
    assert r.status_code == 400 and "messages[0].content[2]" in r.json()["error"]["message"]  # the client's part
    with pytest.raises(openai.AuthenticationError):
        ask(stack["gateway"].url, image_messages(IMAGES[:2]), key="wrong")
    r = httpx.post(url, json={"model": "m", "messages": image_messages(IMAGES[:2])})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}


def test_a_refused_epd_request_gives_its_embeddings_back_at_once(stack) -> None:
    """vLLM refuses an EPD request after the encode (max_tokens beyond its context): the engine never fetches the
    embeddings, and the gateway gives their leases back, so each Eric's pool is as before well within its TTL."""

    def held() -> list[int]:
        return [httpx.get(e.url + "/v1/transfer", headers=e.headers).json()["entries"] for e in stack["erics"]]

    vllm = stack["vllm"]
    model = httpx.get(vllm.url + "/v1/models", headers=vllm.headers).json()["data"][0]["id"]
    before = held()
    images = [image_data_url(88, 64, seed=900 + i) for i in range(3)]
    r = httpx.post(
        stack["gateway"].url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": model, "messages": image_messages(images), "max_tokens": 1_000_000},
        timeout=120,
    )
    assert r.status_code == 400 and r.headers["x-epd-path"] == "epd", r.text
    assert held() == before


def test_encoder_registration_needs_admin_key(stack) -> None:
    url = stack["gateway"].url + "/admin/encoders"
    extra = "http://127.0.0.1:9"  # nothing listens there: health checks eject it
    signed = msgspec.to_builtins(signed_registration(extra, stack["eric_key"]))  # proof that it holds the Eric key
    assert httpx.post(url, json=signed).status_code == 401
    assert httpx.post(url, json=signed, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
    admin = {"Authorization": "Bearer admin-test"}
    assert httpx.post(url, json={"url": extra}, headers=admin).status_code == 403  # no proof: no Eric key for it
    assert extra in httpx.post(url, json=signed, headers=admin).json()["encoders"]
    assert httpx.post(url, json={"url": "ftp://x"}, headers=admin).status_code == 400
    unparsable = msgspec.to_builtins(signed_registration("http://127.0.0.1:9/\x7f", stack["eric_key"]))
    assert httpx.post(url, json=unparsable, headers=admin).status_code == 400  # no call to it could be made
    assert extra not in httpx.request("DELETE", url, json={"url": extra}, headers=admin).json()["encoders"]
    assert httpx.request("DELETE", url, json={"url": extra}, headers=admin).status_code == 404


def test_encoder_killed_under_load_every_request_answers(stack, tmp_path) -> None:
    """The killed Eric (SIGKILL: it cannot drain) holds work by construction: every image set has an image the
    gateway places on it, and this gateway never probes (only a failed call can tell it the Eric is gone), so the
    requests after the kill fail over from it whatever the timing. (An Eric stopped gracefully drains instead:
    tests/gateway/test_drain.py.)"""
    doomed, erics = stack["erics"][0], stack["erics"]
    vllm = stack["vllm"]
    sets, expected = sets_placed_on(
        doomed.url, [e.url for e in erics], 4, 1000, lambda s: ask_greedy(vllm.url, image_messages(s), key=vllm.api_key)
    )
    gw = GatewayServer(
        tmp_path / "gateway.log",
        "--encoder-urls",
        ",".join(e.url for e in erics),
        "--colocated-urls",
        stack["vllm"].url,
        "--api-key",
        API_KEY,
        "--health-interval",
        "3600",
        eric_api_key=stack["eric_key"],
        upstream_api_key=stack["vllm"].api_key,
    )

    segment = httpx.get(doomed.url + "/v1/transfer", headers=doomed.headers).json()["pool_name"]

    def one(i: int):
        if i == 40:
            doomed.kill()  # killed while requests are in flight
            (Path("/dev/shm") / segment).unlink(missing_ok=True)  # what its clean exit would have removed
        return ask_greedy(gw.url, image_messages(sets[i % 4]), key=API_KEY)

    try:
        with gw, ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(200)))
            for i, result in enumerate(results):
                assert_greedy_agree(result, expected[i % 4], NEAR_TIE_FLOAT32, f"request {i}")
            # the negative control: request 0 (set 0) against vLLM's answer for set 1 (images of the same sizes)
            assert_greedy_differ(results[0], expected[1], NEAR_TIE_FLOAT32, "request 0 against set 1's answer")
            assert _failovers(gw) > 0
            assert httpx.get(gw.url + "/health", headers=KEYED).json()["encoders"][doomed.url] is False
    finally:
        doomed.start()  # the Erics are shared by the session's gateway tests


def test_an_eric_refusing_the_gateways_key_is_its_failure_not_the_clients(stack, tmp_path) -> None:
    """A gateway given the wrong Eric key: the Erics' 401s fail over like their 5xx (the client's key was right),
    and with no Eric left the request takes the plain path and answers as vLLM does."""
    images = [image_data_url(60 + 8 * k, 64, seed=1900 + k) for k in range(3)]
    expected = ask_greedy(stack["vllm"].url, image_messages(images), key=stack["vllm"].api_key)
    with GatewayServer(
        tmp_path / "gateway.log",
        "--encoder-urls",
        ",".join(e.url for e in stack["erics"]),
        "--colocated-urls",
        stack["vllm"].url,
        "--api-key",
        API_KEY,
        "--health-interval",
        "3600",
        eric_api_key="not-the-eric-key",
        upstream_api_key=stack["vllm"].api_key,
    ) as gw:
        before = gateway_paths(gw)
        ours = ask_greedy(gw.url, image_messages(images), key=API_KEY)
        assert_greedy_agree(ours, expected, NEAR_TIE_FLOAT32, "fallback after the Erics' 401s")
        assert gateway_paths(gw).get("fallback", 0) - before.get("fallback", 0) == 1
        assert _failovers(gw) >= 1
    others = [image_data_url(60 + 8 * k, 64, seed=1950 + k) for k in range(3)]  # the same sizes, other pixels
    wrong = ask_greedy(stack["vllm"].url, image_messages(others), key=stack["vllm"].api_key)
    assert_greedy_differ(ours, wrong, NEAR_TIE_FLOAT32, "fallback after the Erics' 401s, against other images' answer")


def _failovers(gateway: GatewayServer) -> float:
    text = httpx.get(gateway.url + "/metrics", headers=gateway.metrics_headers).text
    m = re.search(r"^gateway_failovers_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_gateway_reads_each_erics_load_and_recommends_a_count(stack) -> None:
    """The health loop reads every Eric's /v1/load: /health shows each report and the recommended encoder count
    (scaling.py's formula), exported as gateway_recommended_encoders too."""
    gw = stack["gateway"]
    ask(gw.url, image_messages([image_data_url(80, 64, seed=900 + i) for i in range(3)]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(gw.url + "/health", headers=KEYED).json()
        if all(health["encoder_load"].values()):
            break
        time.sleep(0.5)
    loads = health["encoder_load"]
    assert set(loads) == {e.url for e in stack["erics"]} and all(loads.values()), health
    assert all(0 <= r["busy_fraction"] <= 1 and r["items_per_s"] >= 0 for r in loads.values())
    assert isinstance(health["recommended_encoders"], int) and health["recommended_encoders"] >= 1
    text = httpx.get(gw.url + "/metrics", headers=gw.metrics_headers).text
    assert re.search(r"^gateway_recommended_encoders \d", text, re.M)
