"""No route of an engine the project starts answers a stranger: every route of vLLM (behind Eric, started as
`eric-epd up` and the launchers start it) but /health and /metrics needs its key, `/invocations`, `/pooling`,
`/tokenize` and the WebSocket route included; every route of Eric but its own open ones needs Eric's; and vLLM listens
on loopback only."""

from __future__ import annotations

import socket

import httpx
import psutil

from eric_epd.testing.stack import unkeyed_answers


def _listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}


def test_every_vllm_route_needs_the_key(vllm_behind_erics) -> None:
    vllm = vllm_behind_erics["vllm"]
    answers = unkeyed_answers(vllm.url, vllm.headers)
    for route in (("POST", "/invocations"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")):
        assert route in answers, sorted(answers)  # the routes vLLM's own --api-key leaves open are listed
    opened = {route: status for route, status in answers.items() if status != 401}
    assert set(opened) <= {("GET", "/health"), ("GET", "/metrics")}, opened
    assert len(answers) > 20
    for path in ("/health", "/metrics"):
        assert httpx.get(vllm.url + path).status_code == 200
    refused = httpx.post(vllm.url + "/invocations", json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401 and "engine key" in refused.json()["error"]["message"]
    wrong = httpx.post(vllm.url + "/invocations", headers={"Authorization": "Bearer wrong"}, json={})
    assert wrong.status_code == 401
    assert (
        httpx.post(vllm.url + "/tokenize", headers=vllm.headers, json={"prompt": "hello"}).status_code == 200
    )  # the key still opens every route


def test_vllm_websocket_route_needs_the_key(vllm_behind_erics) -> None:
    """The realtime WebSocket route: an unkeyed upgrade is answered 401, never switched."""
    vllm = vllm_behind_erics["vllm"]
    with socket.create_connection(("127.0.0.1", vllm.port), timeout=30) as conn:
        conn.sendall(
            b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        status_line = conn.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"401", status_line


def test_vllm_listens_on_loopback_only(vllm_behind_erics) -> None:
    vllm = vllm_behind_erics["vllm"]
    assert _listening_addresses(vllm.port) == {"127.0.0.1"}


def test_every_eric_route_needs_the_key(vllm_behind_erics) -> None:
    """Eric's own open routes: health, readiness, metrics and SGLang's encoder protocol (bounded by its peer
    allowlist)."""
    eric = vllm_behind_erics["erics"][0]
    answers = unkeyed_answers(eric.url, eric.headers)
    opened = {route: status for route, status in answers.items() if status != 401}
    sglang = {"/encode", "/send", "/scheduler_receive_url", "/scheduler_receive_meta_data", "/health_generate"}
    assert {path for _, path in opened} <= {"/health", "/ready", "/metrics", *sglang}, opened
    assert ("POST", "/v1/encode") in answers
    assert _listening_addresses(eric.port) == {"127.0.0.1"}
