"""The faults the soak (soak.py) injects into a running stack, one at a time: kills and restarts, stops past the
engines' timeouts, a hung global-cache store master, a batch longer than any health probe, and a drain under load."""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import psutil

from eric_epd.stack.process import ServerProcess
from eric_epd.stack.servers import EricServer, GatewayServer, StoreMaster
from eric_epd.testing.media import image_data_url
from eric_epd.wire.handles import ack_request

logger = logging.getLogger("soak")

FAULTS = (
    "eric",
    "eric_stall",
    "eric_worker",
    "store_hang",
    "eric_slow",
    "eric_long_batch",
    "eric_engine",
    "eric_drain",
    "prefill",
    "gateway",
)
"""Cycled in this order, one every --fault-every seconds: kills, and stops (SIGSTOP) that outlast the engines'
fetch and landing timeouts, so a fetch times out, its landing is given up and the same image is fetched again with a
fresh lease; a slow encode keeps its regions until its batch ends; a hung store master (every store call blocks); a
batch longer than the probes (the workers stopped, the engine alive: busy, not dead); a killed engine process fails
its requests only once its workers are gone; a drain (SIGINT) finishes what the Eric holds before it restarts."""
STALL_S = 40.0
"""How long a stopped Eric or store master stays stopped: past the connector's 30 s fetch timeout."""
LONG_BATCH_S = 20.0
"""A batch this long (the workers stopped): ten times the gateway's probe timeout, under Eric's liveness timeout."""


@dataclass
class Stack:
    """The servers, started once and restarted in place (same ports and keys) after each fault."""

    erics: list[EricServer]
    prefill: ServerProcess
    decode: ServerProcess
    gateway: GatewayServer
    store: StoreMaster
    started: dict[str, float] = field(default_factory=dict)
    ejected: list[str] = field(default_factory=list)
    """Erics the gateway listed as unhealthy while they were only busy (eric_long_batch): must stay empty."""

    def components(self) -> dict[str, ServerProcess]:
        """Each server of the stack by name."""
        return {
            "eric_a": self.erics[0],
            "eric_b": self.erics[1],
            "prefill": self.prefill,
            "decode": self.decode,
            "gateway": self.gateway,
            "store": self.store,
        }

    def stop(self) -> None:
        """Stop every server, the gateway first."""
        for server in reversed(list(self.components().values())):
            server.stop()


def restart(server: ServerProcess, attempts: int = 3) -> int:
    """Start a stopped server again in place (same port and key); the attempts it took. On 2 shared cores a start
    can outlast the launcher's own timeout, so it is tried again rather than given up."""
    server._timeout = max(server._timeout, 300.0)
    for attempt in range(1, attempts + 1):
        try:
            server.start()
            return attempt
        except (TimeoutError, RuntimeError) as e:
            logger.warning("restart attempt %d failed: %s", attempt, e)
            server.stop()
    raise RuntimeError(f"{server._cmd[2:4]} did not come back after {attempts} attempts")


def pause(procs: list[psutil.Process], seconds: float, during=None) -> None:
    """SIGSTOP `procs` for `seconds` (calling `during()` every half second meanwhile), then SIGCONT them."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if during is not None:
                during()
            time.sleep(0.5)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)


def stall(eric: EricServer, workers_only: bool) -> str:
    """Stop an Eric's processes (all of them: a stalled Eric; its engine and workers only: a slow encode) for
    STALL_S seconds, then let them go on."""
    assert eric.proc is not None
    router = psutil.Process(eric.proc.pid)
    pause(router.children(recursive=True) if workers_only else [router, *router.children(recursive=True)], STALL_S)
    what = "engine and workers" if workers_only else "router, engine and workers"
    return f"stopped Eric A's {what} for {STALL_S:g} s"


def long_batch(stack: Stack) -> str:
    """Stop Eric B's workers (not its engine) for LONG_BATCH_S and send it an encode of fresh images meanwhile (the
    soak's chats repeat theirs, which the store then serves): to every probe a batch that long is under way. The
    gateway's health view is read meanwhile; an Eric it lists as unhealthy is recorded in `stack.ejected`. The
    encode is answered once the workers go on, and its leases are given back."""
    eric = stack.erics[1]
    pids = httpx.get(eric.url + "/health", headers=eric.headers, timeout=10).json()["worker_pids"]
    statuses: set[str] = set()
    images = [image_data_url(72, 64, seed=90_000 + int(time.time()) % 100_000 + k) for k in range(2)]

    def watch() -> None:
        listed = httpx.get(stack.gateway.url + "/health", headers=stack.gateway.headers, timeout=5).json()
        if listed.get("encoders", {}).get(eric.url) is False:
            stack.ejected.append(eric.url)
        statuses.add(httpx.get(eric.url + "/health", headers=eric.headers, timeout=5).json().get("status", "?"))

    procs = [psutil.Process(p) for p in pids]
    with ThreadPoolExecutor(1) as pool:
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        try:
            answer = pool.submit(
                httpx.post,
                eric.url + "/v1/encode",
                headers=eric.headers,
                timeout=LONG_BATCH_S + 60,
                json={"items": [{"modality": "image", "url": u} for u in images]},
            )
            end = time.monotonic() + LONG_BATCH_S
            while time.monotonic() < end:
                watch()
                time.sleep(0.5)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
        resp = answer.result()
    for item in resp.json().get("items", []) if resp.status_code == 200 else []:
        handle = item["handle"]
        ack = ack_request(handle["producer"], handle["hash"], handle["lease"], handle["instance_id"])
        httpx.post(ack.url, headers={**eric.headers, **ack.headers}, content=ack.content, timeout=10)
    return (
        f"held Eric B's workers for {LONG_BATCH_S:g} s with an encode in flight (its /health said "
        f"{sorted(statuses)}; the encode was answered {resp.status_code} after)"
    )


def drain(stack: Stack) -> str:
    """SIGINT to Eric A under load (it drains: refuses new items, serves the reads and acks of what it handed out),
    then start it again."""
    eric = stack.erics[0]
    start = time.monotonic()
    eric.stop()
    drained = time.monotonic() - start
    tries = restart(eric)
    stack.started["eric_a"] = time.monotonic()
    return f"drained Eric A in {drained:.1f} s, restarted it ({tries} start(s))"


def store_hang(stack: Stack) -> str:
    """Stop the global cache's store master for STALL_S: every Eric's store calls block meanwhile."""
    assert stack.store.proc is not None
    pause([psutil.Process(stack.store.proc.pid)], STALL_S)
    return f"stopped the store master for {STALL_S:g} s"


def kill(server: ServerProcess) -> None:
    """SIGKILL the server's whole process group (no graceful stop), then reap it."""
    server.kill()


def inject(stack: Stack, fault: str) -> str:
    """Kill one component and restart it, or stop one for a while; returns what was done."""
    if fault in ("eric_stall", "eric_slow"):
        return stall(stack.erics[0], workers_only=fault == "eric_slow")
    special = {"eric_long_batch": long_batch, "eric_drain": drain, "store_hang": store_hang}
    if fault in special:
        return special[fault](stack)
    if fault in ("eric_worker", "eric_engine"):
        eric = stack.erics[1]
        pid = httpx.get(eric.url + "/health", headers=eric.headers, timeout=10).json()["worker_pids"][0]
        what = "worker"
        if fault == "eric_engine":
            pid, what = psutil.Process(pid).ppid(), "engine"
        os.kill(pid, signal.SIGKILL)
        time.sleep(5)  # requests meanwhile get 503 from it, the gateway ejects it
        kill(eric)
        tries = restart(eric)
        stack.started["eric_b"] = time.monotonic()
        return f"killed Eric B's {what} {pid}, restarted Eric B ({tries} start(s))"
    name, server = {
        "eric": ("eric_a", stack.erics[0]),
        "prefill": ("prefill", stack.prefill),
        "gateway": ("gateway", stack.gateway),
    }[fault]
    kill(server)
    tries = restart(server)
    stack.started[name] = time.monotonic()
    return f"killed and restarted {name} ({tries} start(s))"
