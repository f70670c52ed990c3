"""Erics found by name (gateway --encoder-dns, connector eric_dns): the name's parsing and URLs, the pool's
admit/dismiss and acks, and real Erics joining and leaving under load behind one name that a private hosts file
(a mount namespace per server) resolves to several loopback addresses; every chat answers as vLLM's own tower does."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from epd_gateway.config import parse_args
from epd_gateway.dns_members import DnsMembers
from epd_gateway.encoders import EncoderPool
from epd_gateway.metrics import GatewayMetrics

from eric_epd.common.dns import DnsTarget, address_url, is_address_url, parse_dns_target
from eric_epd.plugins.vllm.settings import EricConnectorSettings
from eric_epd.plugins.vllm.trust import TrustedProducers
from eric_epd.stack.process import free_port, new_key, running
from eric_epd.stack.servers import EricServer, GatewayServer, VllmServe
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, Greedy, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.stack import ask_greedy, gateway_paths, image_messages, metric, wait_for
from tests.support.placement import sets_placed_on

API_KEY = "sk-dns-members"
NAME = "erics.test"
PACE_S = 0.15
"""One chat every PACE_S (open loop) while the name's answer changes."""
PER_SET = 20
"""Chats per image set: each set is fresh, so new items keep being placed on the name's current members."""
AFTER_LEAVING = 20
"""Chats sent after the first Eric stopped."""


def test_names_parse_and_their_urls_are_exact() -> None:
    assert parse_dns_target("Erics.ns.svc.cluster.local:8100") == DnsTarget("erics.ns.svc.cluster.local", 8100)
    for bad in ("erics", "erics:", ":8100", "erics:0", "erics:70000", "http://erics:8100", "a b:1", "[::1]:8100"):
        with pytest.raises(ValueError):
            parse_dns_target(bad)
    assert address_url("10.0.0.5", 8100) == "http://10.0.0.5:8100"
    assert address_url("fd00::5%eth0", 8100) == "http://[fd00::5]:8100"
    assert is_address_url("http://10.0.0.5:8100", {8100}) and is_address_url("http://[fd00::5]:8100", {8100})
    for other in (
        "http://10.0.0.5:8101",
        "https://10.0.0.5:8100",
        "http://eric:8100",
        "http://10.0.0.5:8100/",
        "http://user@10.0.0.5:8100",
        "http://010.0.0.5:8100",
        "http://[fd00:0::5]:8100",
    ):
        assert not is_address_url(other, {8100}), other
    config = parse_args(
        [
            "--encoder-dns",
            "erics:8100",
            "--encoder-dns",
            "erics:8100",
            "--dns-interval",
            "0.5",
            "--colocated-urls",
            "http://vllm:8000",
        ]
    )
    assert config.encoder_dns == (DnsTarget("erics", 8100),) and config.dns_interval_s == 0.5
    with pytest.raises(SystemExit):
        parse_args(["--encoder-dns", "erics", "--colocated-urls", "http://vllm:8000"])
    settings = EricConnectorSettings.parse({"eric_dns": ["erics:8100"], "dns_interval_s": 1}, environ={})
    assert settings.eric_urls == () and settings.eric_dns == (DnsTarget("erics", 8100),)
    assert settings.dns_interval_s == 1.0
    with pytest.raises(ValueError):
        EricConnectorSettings.parse({"eric_dns": ["erics"]}, environ={})


def test_pool_admits_and_dismisses_by_name_and_acks_those_that_left() -> None:
    async def scenario() -> tuple[list[str], list[str], list[str], list[bool]]:
        async with httpx.AsyncClient() as client:
            pool = EncoderPool(
                ("http://10.0.0.1:8100",), client, None, GatewayMetrics(), 2, 5.0, heartbeat_timeout_s=0.0
            )
            pool.register("http://10.0.0.2:8100")  # self-registered, then listed by name: no heartbeat any more
            pool.admit("http://10.0.0.2:8100")
            pool.admit("http://10.0.0.3:8100")
            admitted = pool.urls
            silent = pool.drop_silent()
            pool.dismiss("http://10.0.0.1:8100")  # listed by hand: stays
            pool.dismiss("http://10.0.0.3:8100")
            known = [pool.knows(f"http://10.0.0.{n}:8100") for n in (1, 2, 3, 4)]
            return admitted, silent, pool.urls, known

    admitted, silent, left, known = asyncio.run(scenario())
    assert admitted == ["http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"]
    assert silent == []
    assert left == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    assert known == [True, True, True, False]  # the one that left can still be given its leases back


def test_dns_members_follow_the_answer_and_keep_members_when_a_lookup_fails() -> None:
    """Real lookups: localhost resolves to loopback addresses; a .invalid name never resolves (RFC 6761)."""
    port = free_port()

    async def scenario() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient() as client:
            pool = EncoderPool((), client, None, GatewayMetrics(), 2, 5.0)
            members = DnsMembers((DnsTarget("localhost", port), DnsTarget("nothing.invalid", port)), pool, 1.0)
            await members.refresh()
            first = pool.urls
            members._targets = (DnsTarget("nothing.invalid", port),)  # the name's lookup now fails: members stay
            await members.refresh()
            return first, pool.urls

    first, after_failure = asyncio.run(scenario())
    assert f"http://127.0.0.1:{port}" in first
    assert all(is_address_url(u, {port}) for u in first)
    assert after_failure == first


def test_connector_trusts_only_a_name_s_addresses_and_waits_for_a_fresh_lookup() -> None:
    port = free_port()
    trust = TrustedProducers(["http://eric:8100"], [DnsTarget("localhost", port)], interval_s=60.0)
    try:
        member = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: trust.settled([member]), 10)  # the first lookup ran in the background
        assert member in trust and "http://eric:8100" in trust
        assert member in list(trust)
        assert f"http://localhost:{port}" not in trust  # a name in a handle is never looked up
        assert trust.settled([f"http://localhost:{port}", "http://127.0.0.1:1"])  # not of the names' shape
        stranger = f"http://127.0.0.9:{port}"
        assert not trust.settled([stranger])  # may have just joined: its request waits for a new lookup
        assert trust.asking()
        assert wait_for(lambda: trust.settled([stranger]), 10)  # that lookup ended without it
        assert stranger not in trust and not trust.asking()
    finally:
        trust.close()


# ---- real Erics joining and leaving behind one name ------------------------------------------------------------


def _namespaced(hosts: Path) -> tuple[str, ...]:
    """A command prefix: the command runs in its own mount namespace where /etc/hosts is `hosts` (bind mount; glibc
    reads /etc/hosts on every lookup, so rewriting `hosts` in place changes the answer at once)."""
    return ("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts))


def _write_hosts(hosts: Path, base: str, addresses: list[str]) -> None:
    """Rewrite the file in place (same inode: the bind mounts see the new content)."""
    text = base + "".join(f"{a} {NAME}\n" for a in addresses)
    with hosts.open("r+") as f:
        f.truncate(0)
        f.write(text)


def _eric(model: Path, address: str, port: int, key: str, log: Path) -> EricServer:
    eric = EricServer(model, port=port, api_key=key, log_path=log, extra_args=("--host", address))
    eric.url = f"http://{address}:{port}"  # ServerProcess assumes 127.0.0.1
    return eric


def _listed(gateway: GatewayServer) -> set[str]:
    return set(httpx.get(gateway.url + "/health", headers=gateway.headers, timeout=10).json()["encoders"])


def _quiet(eric: EricServer) -> bool:
    """No /v1/encode call in progress (read but unanswered) and no lease held."""
    reading = metric(eric.url, 'eric_stage_seconds_count{stage="body_read"}') - metric(eric.url, "eric_requests_total")
    pool = httpx.get(eric.url + "/v1/transfer", headers=eric.headers, timeout=10).json()
    return reading == 0 and pool["used_bytes"] == 0


class _ImageSets:
    """Set k (three fresh images, at least one placed by rendezvous on `joiner` among `urls`, whose `reference` answer
    has no near tie in its first MIN_STEPS steps), made on demand with that answer. The placement depends on the
    servers' random port, so the sets differ from run to run: one whose answer ties early would compare too little."""

    def __init__(self, joiner: str, urls: list[str], reference: Callable[[list[str]], Greedy]) -> None:
        self._joiner, self._urls, self._reference = joiner, urls, reference
        self._sets: dict[int, list[str]] = {}
        self.expected: dict[int, Greedy] = {}
        self._lock = threading.Lock()

    def __getitem__(self, k: int) -> list[str]:
        with self._lock:
            if k not in self._sets:
                [images], [answer] = sets_placed_on(self._joiner, self._urls, 1, 5000 + 1000 * k, self._reference)
                self._sets[k], self.expected[k] = images, answer
            return self._sets[k]

    def used(self) -> list[int]:
        return sorted(self._sets)


def _warnings(log: Path) -> str:
    """The gateway's warnings (why each failed call failed), for an assertion's message."""
    return "\n".join(line for line in log.read_text(errors="replace").splitlines() if " WARNING " in line)[-4000:]


def test_erics_join_and_leave_by_name_under_load_and_none_is_lost(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    port, key = free_port(), new_key()
    base = Path("/etc/hosts").read_text().rstrip("\n") + "\n"
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    _write_hosts(hosts, base, ["127.0.0.5"])
    first = _eric(qwen2_vl_tiny, "127.0.0.5", port, key, tmp_path / "eric1.log")
    second = _eric(qwen2_vl_tiny, "127.0.0.6", port, key, tmp_path / "eric2.log")  # ready, not yet in the name
    vllm = VllmServe(
        qwen2_vl_tiny, tmp_path / "vllm.log", eric_dns=[f"{NAME}:{port}"], eric_api_key=key, wrap=_namespaced(hosts)
    )
    sets = _ImageSets(
        second.url,
        [first.url, second.url],
        lambda images: ask_greedy(vllm.url, image_messages(images), key=vllm.api_key),
    )
    futures: list[Future[Greedy]] = []
    stop = threading.Event()

    def one(i: int) -> Greedy:
        return ask_greedy(gw.url, image_messages(sets[i // PER_SET]), key=API_KEY)

    def send(pool: ThreadPoolExecutor) -> None:
        start = time.monotonic()
        while not stop.is_set() and len(futures) < 2000:
            time.sleep(max(0.0, start + len(futures) * PACE_S - time.monotonic()))  # open loop
            futures.append(pool.submit(one, len(futures)))

    def answered_since(n: int) -> bool:
        return len(futures) > n and futures[n].done()

    with running(first, second, vllm):
        gw = GatewayServer(
            tmp_path / "gateway.log",
            "--encoder-dns",
            f"{NAME}:{port}",
            "--dns-interval",
            "0.5",
            "--colocated-urls",
            vllm.url,
            api_key=API_KEY,
            eric_api_key=key,
            upstream_api_key=vllm.api_key,
            wrap=_namespaced(hosts),
        )
        with gw, ThreadPoolExecutor(8) as pool:
            assert _listed(gw) == {first.url}
            sender = threading.Thread(target=send, args=(pool,), daemon=True)
            sender.start()
            try:
                assert wait_for(lambda: sum(f.done() for f in list(futures)) >= 30, 180)
                assert metric(second.url, "eric_items_total") == 0  # not in the name: sent nothing
                _write_hosts(hosts, base, ["127.0.0.5", "127.0.0.6"])  # a new pod becomes ready
                assert wait_for(lambda: _listed(gw) == {first.url, second.url}, 30), "the new Eric was not admitted"
                assert wait_for(lambda: metric(second.url, "eric_items_total") > 0, 60), "the new Eric got nothing"
                _write_hosts(hosts, base, ["127.0.0.6"])  # the first pod is terminating
                assert wait_for(lambda: _listed(gw) == {second.url}, 30), "the leaving Eric was not removed"
                dropped = len(futures)
                assert wait_for(lambda: answered_since(dropped), 120)  # a chat sent after it left has answered
                assert wait_for(lambda: _quiet(first), 60), "the leaving Eric still holds work"
                first.stop()  # stops listening only now
                stopped = len(futures)
                assert wait_for(lambda: answered_since(stopped + AFTER_LEAVING - 1), 180)
            finally:
                stop.set()
                sender.join()
            results = [f.result(timeout=300) for f in futures]
            # no call to a leaving Eric failed; a 503 with Retry-After (an Eric busy under the suite's load, or
            # draining) is a rest the gateway passes over, not a failure, though it counts as a failover
            failed = metric(gw.url, 'gateway_failures_total{stage="encode"}', gw.metrics_headers)
            assert failed == 0, _warnings(tmp_path / "gateway.log")
            paths = gateway_paths(gw)
            assert paths.get("epd") == len(results) and not paths.get("fallback"), paths
            assert _listed(gw) == {second.url}
            assert wait_for(lambda: _quiet(second), 60), "leases left on the Eric that stayed"
        expected = sets.expected  # vLLM's own tower's answers, asked as each set was made
    for i, result in enumerate(results):  # EPD against vLLM's own tower: exact up to the first near tie
        assert_greedy_agree(result, expected[i // PER_SET], NEAR_TIE_FLOAT32, f"chat {i}")
    # the negative control: chat 0 (set 0) against vLLM's answer for set 1 (three images of the same sizes)
    assert_greedy_differ(results[0], expected[1], NEAR_TIE_FLOAT32, "chat 0 against image set 1's answer")
