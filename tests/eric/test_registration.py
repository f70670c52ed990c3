"""Registration that cannot steal, against real gateways, real Erics and a real vLLM: an Eric registers only from and
at --register-from networks and, when the gateway holds the Erics' key, only with proof that it holds it too (a
refused URL is never contacted); acknowledgements go only to Erics the gateway knows; a load report is bounded by
what the gateway observes; and no key appears on a started server's command line."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from eric_epd.common.registration import Registration, registration_proof, signed_registration
from eric_epd.stack.servers import GatewayServer
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages, metric, wait_for
from eric_epd.testing.standins import CountingListener, ProxyEric, process_group_cmdlines
from tests.support.placement import rendezvous_first

API_KEY, ADMIN_KEY = "sk-registration", "admin-registration"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
KEYED = {"Authorization": f"Bearer {API_KEY}"}
"""What /health wants before it names the encoders."""
HONEST = {"queue_depth": 2, "busy_fraction": 0.5, "items_per_s": 1.0, "p99_encode_s": 0.1, "window_s": 30.0}
"""Two seconds of queued work: a new item leaves its rendezvous Eric for one that would start it 0.5 s sooner."""
ABSURD = {"queue_depth": 0, "busy_fraction": 0.0, "items_per_s": 1e12, "p99_encode_s": 0.0, "window_s": 30.0}


def _body(registration: Registration) -> dict:
    return {
        k: v
        for k, v in (("url", registration.url), ("proof", registration.proof), ("ts", registration.ts))
        if v is not None
    }


def _post(gateway: GatewayServer, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(gateway.url + "/admin/encoders", json=body, headers={**ADMIN, **(headers or {})}, timeout=30)


def _listed(gateway: GatewayServer) -> set[str]:
    return set(httpx.get(gateway.url + "/health", headers=KEYED).json()["encoders"])


@pytest.fixture(scope="module")
def servers(vllm_behind_erics, tmp_path_factory: pytest.TempPathFactory):
    """open: registration from loopback, no Eric listed; closed: no --register-from, one Eric behind a proxy that
    names a counting listener as its producer, one listed as is; loads: two proxies reporting an honest backlog and
    one reporting an absurd load, registration only from 10.0.0.0/8."""
    logs = tmp_path_factory.mktemp("registration")
    erics, vllm, key = vllm_behind_erics["erics"], vllm_behind_erics["vllm"], vllm_behind_erics["eric_key"]
    keys = {"eric_api_key": key, "upstream_api_key": vllm.api_key, "api_key": API_KEY, "admin_key": ADMIN_KEY}
    with (
        CountingListener() as foreign,
        CountingListener() as refused,
        CountingListener() as probed,
        ProxyEric(erics[0].url, producer=foreign.url) as renamer,
        ProxyEric(erics[0].url, load=HONEST) as honest_a,
        ProxyEric(erics[1].url, load=HONEST) as honest_b,
        ProxyEric(erics[0].url, load=ABSURD, hold=True) as rogue,
    ):
        gateways = {
            "open": GatewayServer(
                logs / "open.log",
                "--colocated-urls",
                vllm.url,
                "--register-from",
                "127.0.0.0/8",
                "--heartbeat-timeout",
                "3600",
                **keys,
            ),
            "closed": GatewayServer(
                logs / "closed.log",
                "--encoder-urls",
                f"{renamer.url},{erics[1].url}",
                "--colocated-urls",
                vllm.url,
                **keys,
            ),
            "loads": GatewayServer(
                logs / "loads.log",
                "--encoder-urls",
                ",".join(p.url for p in (honest_a, honest_b, rogue)),
                "--colocated-urls",
                vllm.url,
                "--register-from",
                "10.0.0.0/8",
                **keys,
            ),
        }
        try:
            for gateway in gateways.values():
                gateway.start()
            yield {
                **gateways,
                "erics": erics,
                "vllm": vllm,
                "key": key,
                "foreign": foreign,
                "refused": refused,
                "probed": probed,
                "honest": (honest_a, honest_b),
                "rogue": rogue,
            }
        finally:
            rogue.release()
            for gateway in gateways.values():
                gateway.stop()


def test_registration_needs_the_admin_key_first(servers) -> None:
    gw, url = servers["open"], servers["erics"][0].url
    body = _body(signed_registration(url, servers["key"]))
    assert httpx.post(gw.url + "/admin/encoders", json=body).status_code == 401
    assert (
        httpx.post(gw.url + "/admin/encoders", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code
        == 401
    )
    assert _post(gw, {"url": "ftp://x"}).status_code == 400
    assert _post(gw, {"url": url, "extra": 1}).status_code == 400


def test_without_register_from_registration_is_refused(servers) -> None:
    gw, url = servers["closed"], servers["erics"][0].url
    resp = _post(gw, _body(signed_registration(url, servers["key"])))
    assert resp.status_code == 403 and "--register-from" in resp.json()["error"]["message"], resp.text
    resp = httpx.request("DELETE", gw.url + "/admin/encoders", json={"url": url}, headers=ADMIN)
    assert resp.status_code == 403 and "--register-from" in resp.json()["error"]["message"], resp.text


def test_caller_outside_register_from_is_refused(servers) -> None:
    """The gateway takes registrations from 10.0.0.0/8 only; this caller is on loopback."""
    gw, url = servers["loads"], servers["erics"][0].url
    resp = _post(gw, _body(signed_registration(url, servers["key"])))
    assert resp.status_code == 403 and "outside --register-from" in resp.json()["error"]["message"], resp.text


def test_url_outside_register_from_or_through_a_proxy_is_refused(servers) -> None:
    gw, key, url = servers["open"], servers["key"], servers["erics"][0].url
    resp = _post(gw, _body(signed_registration("http://10.1.2.3:8100", key)))
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "url", resp.text
    for name in ("http://no-such-host.invalid:8100", "http://localhost:8100"):  # even one resolving inside it
        resp = _post(gw, _body(signed_registration(name, key)))  # would be resolved again at every call
        assert resp.status_code == 400 and "is a name" in resp.json()["error"]["message"], resp.text
    resp = _post(gw, _body(signed_registration(url, key)), {"X-Forwarded-For": "127.0.0.1"})
    assert resp.status_code == 403 and "proxy" in resp.json()["error"]["message"], resp.text
    assert _listed(gw) == set()


def test_without_proof_of_the_eric_key_the_url_is_refused_and_never_contacted(servers) -> None:
    gw, key, refused, probed = servers["open"], servers["key"], servers["refused"], servers["probed"]
    now = int(time.time())
    bodies = [
        {"url": refused.url},  # no proof
        _body(signed_registration(refused.url, "not-the-eric-key")),
        {"url": refused.url, "proof": registration_proof(key, refused.url, now - 120), "ts": now - 120},  # stale
        {"url": refused.url, "proof": registration_proof(key, probed.url, now), "ts": now},  # another URL's
        {"url": refused.url, "proof": "00" * 32, "ts": now},
    ]
    for body in bodies:
        resp = _post(gw, body)
        assert resp.status_code == 403 and resp.json()["error"]["param"] == "proof", (body, resp.text)
    assert _listed(gw) == set()
    # a URL registered with its proof afterwards is probed: two probes of it mean a whole health round passed
    assert _post(gw, _body(signed_registration(probed.url, key))).status_code == 200
    assert wait_for(lambda: probed.requests["/health"] >= 2, 30), probed.requests
    assert sum(refused.requests.values()) == 0, refused.requests
    resp = httpx.request("DELETE", gw.url + "/admin/encoders", json={"url": probed.url}, headers=ADMIN)
    assert resp.status_code == 200 and probed.url not in resp.json()["encoders"]


def test_eric_registered_with_its_proof_encodes(servers) -> None:
    gw, eric = servers["open"], servers["erics"][0]
    resp = _post(gw, _body(signed_registration(eric.url, servers["key"])))
    assert resp.status_code == 200 and resp.json()["encoders"] == [eric.url], resp.text
    assert wait_for(lambda: httpx.get(gw.url + "/health", headers=KEYED).json()["encoders"].get(eric.url) is True)
    before = metric(eric.url, "eric_items_total")
    msgs = image_messages([image_data_url(72, 64, seed=4100 + i) for i in range(2)])
    answer = _chat(gw, _model(servers), msgs, 4)
    assert answer.status_code == 200 and answer.headers["x-epd-path"] == "epd", answer.text
    assert metric(eric.url, "eric_items_total") == before + 2
    resp = httpx.request("DELETE", gw.url + "/admin/encoders", json={"url": eric.url}, headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["encoders"] == []
    resp = httpx.request("DELETE", gw.url + "/admin/encoders", json={"url": eric.url}, headers=ADMIN)
    assert resp.status_code == 404


def _model(servers) -> str:
    vllm = servers["vllm"]
    return httpx.get(vllm.url + "/v1/models", headers=vllm.headers).json()["data"][0]["id"]


def _chat(gateway: GatewayServer, model: str, msgs: list[dict], max_tokens: int) -> httpx.Response:
    return httpx.post(
        gateway.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": model, "messages": msgs, "max_tokens": max_tokens},
        timeout=300,
    )


def test_no_ack_goes_to_a_producer_the_gateway_does_not_know(servers) -> None:
    """A request the engine refuses gives its leases back: the item from the Eric listed as is is acknowledged there
    (its lease ends), the one whose answer names a foreign producer is not (the listener there sees nothing)."""
    gw, known, foreign = servers["closed"], servers["erics"][1], servers["foreign"]
    members = list(httpx.get(gw.url + "/health", headers=KEYED).json()["encoders"])
    assert len(members) == 2 and known.url in members
    placed: dict[str, str] = {}  # one image placed on each member, by construction
    seed = 4200
    while len(placed) < 2:
        image = image_data_url(80, 64, seed=seed)
        seed += 1
        placed.setdefault(rendezvous_first(image, members), image)

    def held() -> int:
        return httpx.get(known.url + "/v1/transfer", headers=known.headers).json()["entries"]

    before = held()
    resp = _chat(gw, _model(servers), image_messages(list(placed.values())), 1_000_000)
    assert resp.status_code == 400 and resp.headers["x-epd-path"] == "epd", resp.text
    assert held() == before  # the known Eric's lease was given back
    assert sum(foreign.requests.values()) == 0, foreign.requests


def test_an_absurd_load_report_does_not_attract_most_items(servers) -> None:
    """Two Erics report two seconds of queued work, one claims no queue and 1e12 items/s and holds what it is sent.
    Believed, it would take every chat's items until the bounded-load rule stops it (15 of 18); checked against what
    the gateway saw it answer (nothing yet: at most 4 items/s) and its items in flight, it takes two chats' worth and
    the rest stay on their own Erics. Each chat starts once the one before was placed."""
    gw, rogue, honest = servers["loads"], servers["rogue"], servers["honest"]
    members = [honest[0].url, honest[1].url, rogue.url]
    assert wait_for(lambda: all(httpx.get(gw.url + "/health", headers=KEYED).json()["encoder_load"].values()), 30)
    load = httpx.get(gw.url + "/health", headers=KEYED).json()["encoder_load"]
    assert load[rogue.url]["items_per_s"] <= 4.0 and load[honest[0].url]["items_per_s"] == 1.0, load
    sets, seed = [], 4300
    while len(sets) < 6:  # none of these images has the lying Eric as its own (rendezvous) Eric
        images = [image_data_url(64 + 8 * k, 64, seed=seed + k) for k in range(3)]
        seed += 10
        if all(rendezvous_first(u, members) != rogue.url for u in images):
            sets.append(images)
    model = _model(servers)
    with ThreadPoolExecutor(len(sets)) as pool:
        futures = []
        for images in sets:
            held = rogue.received
            future = pool.submit(_chat, gw, model, image_messages(images), 2)
            futures.append(future)
            placed = wait_for(lambda f=future, h=held: f.done() or rogue.received == h + 3, 120)
            assert placed, (rogue.received, [h.answered for h in honest])
        taken = rogue.received
        rogue.release()
        answers = [f.result() for f in futures]
    assert all(a.status_code == 200 and a.headers["x-epd-path"] == "epd" for a in answers), [a.text for a in answers]
    assert taken < 9, f"the lying Eric took {taken} of 18 items"
    assert taken + sum(h.answered for h in honest) == 18


def test_no_key_on_a_started_servers_command_line(servers) -> None:
    """The gateways (their own, the Erics' and the engine's keys), the Erics and vLLM take their keys by
    environment: none shows in /proc/PID/cmdline of any of their processes."""
    keys = (API_KEY, ADMIN_KEY, servers["key"], servers["vllm"].api_key)
    for server in (servers["open"], servers["closed"], servers["loads"], *servers["erics"], servers["vllm"]):
        assert server.proc is not None
        lines = process_group_cmdlines(server.proc.pid)
        assert lines and not any(k in line for k in keys for line in lines), (server.url, lines)
