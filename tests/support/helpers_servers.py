"""Live-server helpers shared by tests: start-ups in threads, a process stopped for a while, an abandoned raw POST,
and reading an item from an Eric with its lease, then the ack."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import httpx

from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import EricServer
from eric_epd.wire.handles import LEASE_HEADER

if TYPE_CHECKING:
    import torch


def start_in_threads(servers: Iterable[ServerProcess]) -> Callable[[], None]:
    """Start every server in a thread of its own (the caller may do other work meanwhile); the returned function
    waits for all of them, then raises the first start-up error if there was one."""
    errors: list[BaseException] = []

    def boot(server: ServerProcess) -> None:
        try:
            server.start()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=boot, args=(server,)) for server in servers]
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    return join


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process does nothing (SIGSTOP) inside the block: a batch sent to it stays running."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def post_raw(port: int, path: str, body: dict, headers: dict[str, str]) -> socket.socket:
    """Send a whole POST and return the open socket without reading the answer (the caller abandons it)."""
    payload = json.dumps(body).encode()
    head = "".join(
        f"{k}: {v}\r\n"
        for k, v in {
            **headers,
            "Host": "127.0.0.1",
            "Content-Type": "application/json",
            "Content-Length": str(len(payload)),
        }.items()
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + payload)
    return sock


def read_and_ack(eric: ServerProcess, item: dict) -> bytes:
    """The embedding's safetensors payload through /v1/embeddings/<hash> with the item's lease, then the ack (from
    an Eric, or any producer serving that API)."""
    handle = item["handle"]
    lease = eric.headers | {LEASE_HEADER: handle["lease"]}
    got = httpx.get(handle["http"], headers=lease, timeout=30)
    assert got.status_code == 200, got.text
    ack = httpx.post(
        f"{eric.url}/v1/embeddings/{item['hash']}/ack",
        headers=lease,
        timeout=30,
        json={"instance_id": handle["instance_id"]},
    )
    assert ack.status_code == 200, ack.text
    return got.content


def encode_items(eric: EricServer, items: list[dict], timeout: float = 120) -> httpx.Response:
    """POST /v1/encode with `items`."""
    return httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=timeout)


def embedding_rows(eric: EricServer, item: dict) -> torch.Tensor:
    """An answered item's embedding read over HTTP with its own lease (no ack)."""
    from safetensors.torch import load as load_safetensors

    handle = item["handle"]
    fetched = httpx.get(handle["http"], headers=eric.headers | {LEASE_HEADER: handle["lease"]})
    assert fetched.status_code == 200, fetched.text
    return load_safetensors(fetched.content)["embedding"]
