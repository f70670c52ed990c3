"""Hostile-caller tools for Eric's SGLang routes: a listener that records connects, a client bound to a chosen
source address, raw partial POSTs, and the checks of SGLang's error shape."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

import httpx

ELSEWHERE = "127.0.0.2"  # a local address that is not the callers' (tests call from 127.0.0.1)


class Listener:
    """A TCP listener on another local address that records whether anyone connected."""

    def __init__(self, host: str = ELSEWHERE) -> None:
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(1.5)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.endpoint = f"{host}:{self.port}"

    def connected(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return False
        conn.close()
        return True

    def close(self) -> None:
        self.sock.close()


def client_from(source: str) -> httpx.Client:
    """An HTTP client whose connections leave from `source` (Eric sees it as the caller's address)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60)


def assert_sglang_error(resp: httpx.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["status"] == "error" and isinstance(body["message"], str) and "req_id" in body, body
    for word in words:
        assert word in body["message"], body["message"]


def send_body(rid: str, host: str, port: int, session: str) -> dict[str, Any]:
    return {
        "req_id": rid,
        "part_idx": 0,
        "prefill_host": host,
        "embedding_port": port,
        "session_id": session,
        "buffer_address": 4096,
        "receive_count": 1,
    }


def raw_post(url: str, path: str, declared: int, sent: int) -> tuple[int, dict[str, Any]]:
    """POST declaring `declared` body bytes but sending only `sent`, then read the answer (10 s at most): a server
    that waited for the whole body would not answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n".encode()
            + b"x" * sent
        )
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())
