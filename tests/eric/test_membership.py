"""Erics that join and leave by themselves (`eric-epd serve --register-with GATEWAY`): one joins and later drains and
leaves while 200 chats go through the gateway to real vLLM, and none is lost or answered differently; one killed
outright is dropped once its heartbeats stop."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, Greedy, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.stack import ask_greedy, image_messages, metric, wait_for
from eric_epd.testing.standins import process_group_cmdlines
from tests.support.placement import sets_placed_on

API_KEY, ADMIN_KEY = "sk-membership", "admin-membership"
PACE_S = 0.15
"""200 chats over 30 s: the Eric joins, serves and leaves while they run."""


def _listed(gateway: GatewayServer) -> set[str]:
    return set(httpx.get(gateway.url + "/health", headers=gateway.headers).json()["encoders"])


def test_erics_join_and_leave_under_load_and_none_is_lost(
    vllm_behind_erics, qwen2_vl_tiny: Path, tmp_path: Path
) -> None:
    static, slot = vllm_behind_erics["erics"]  # the joiner takes the second Eric's address, which vLLM trusts
    vllm, key = vllm_behind_erics["vllm"], vllm_behind_erics["eric_key"]
    # fresh images every 20 chats (items already answered go back to the Eric that holds them), each set with an
    # image the gateway places on the joiner once it is there: the joiner gets work by construction
    # (the eleventh set is sent once the joiner is in, however far the 200 chats have got by then)
    sets, expected = sets_placed_on(
        slot.url, [static.url, slot.url], 11, 2000, lambda s: ask_greedy(vllm.url, image_messages(s), key=vllm.api_key)
    )
    gw = GatewayServer(
        tmp_path / "gateway.log",
        "--encoder-urls",
        static.url,
        "--colocated-urls",
        vllm.url,
        "--register-from",
        "127.0.0.0/8",
        "--heartbeat-timeout",
        "3",
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        eric_api_key=key,
        upstream_api_key=vllm.api_key,
    )
    joiner = EricServer(
        qwen2_vl_tiny,
        port=slot.port,
        api_key=key,
        log_path=tmp_path / "joiner.log",
        register_key=ADMIN_KEY,
        extra_args=("--register-with", gw.url, "--heartbeat", "0.5"),
    )

    def one(i: int) -> Greedy:
        time.sleep(max(0.0, start + i * PACE_S - time.monotonic()))  # open loop: one chat every PACE_S
        return ask_greedy(gw.url, image_messages(sets[i // 20]), key=API_KEY)

    slot.stop()
    try:
        with gw, ThreadPoolExecutor(8) as pool:
            start = time.monotonic()
            futures = [pool.submit(one, i) for i in range(200)]
            assert wait_for(lambda: sum(f.done() for f in futures) >= 30, 120)
            joiner.start()  # joins by itself while the chats go on
            assert wait_for(lambda: joiner.url in _listed(gw)), "the Eric did not join"  # with its key's proof
            assert joiner.proc is not None and ADMIN_KEY not in " ".join(process_group_cmdlines(joiner.proc.pid))
            assert_greedy_agree(
                ask_greedy(gw.url, image_messages(sets[10]), key=API_KEY),
                expected[10],
                NEAR_TIE_FLOAT32,
                "a chat after the join",
            )
            assert wait_for(lambda: metric(joiner.url, "eric_items_total") > 0, 30), "the joined Eric encoded nothing"
            joiner.stop()  # leaves the gateway, then drains: finishes what it holds, refuses new connections
            results = [f.result(timeout=300) for f in futures]
            assert sum(f.done() for f in futures) == 200
            for i, result in enumerate(results):  # EPD against vLLM's own tower: exact up to the first near tie
                assert_greedy_agree(result, expected[i // 20], NEAR_TIE_FLOAT32, f"chat {i}")
            # the negative control: chat 0 (set 0) against vLLM's answer for set 1 (images of the same sizes)
            assert_greedy_differ(results[0], expected[1], NEAR_TIE_FLOAT32, "chat 0 against set 1's answer")
            assert _listed(gw) == {static.url}  # it left
            # it left before it stopped listening
            assert metric(gw.url, "gateway_failovers_total", gw.metrics_headers) == 0
            joiner.start()  # joins again, then dies without a word: dropped when its heartbeats stop
            assert wait_for(lambda: joiner.url in _listed(gw))
            assert joiner.proc is not None
            os.killpg(joiner.proc.pid, signal.SIGKILL)
            assert wait_for(lambda: joiner.url not in _listed(gw), 10.0), "a silent Eric was not dropped"
            assert_greedy_agree(ask_greedy(gw.url, image_messages(sets[0]), key=API_KEY), expected[0], NEAR_TIE_FLOAT32)
    finally:
        joiner.stop()
        slot.start()  # the Erics are shared by the session's gateway tests
