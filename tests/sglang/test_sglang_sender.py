"""The ZMQ side of Eric's SGLang pushes, without servers: a rank on IPv6 gets its part; a part's sends all end before
its rows are let go (one failing, or the caller cancelled); an /encode naming ports names each once and at most
MAX_RANKS."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from eric_epd.eric.config import SglangConfig
from eric_epd.eric.sglang.peers import PeerPolicy
from eric_epd.eric.sglang.protocol import MAX_RANKS, SglangError
from eric_epd.eric.sglang.zmq_push import ZmqSender, all_sent
from eric_epd.wire.sglang import EncodeRequest


@pytest.mark.parametrize("cached", [False, True])
def test_a_rank_listening_on_ipv6_gets_its_part(cached: bool) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.IPV6, 1)
    port = pull.bind_to_random_port("tcp://[::1]")

    async def push() -> None:
        sender = ZmqSender(timeout_s=30)
        try:
            await sender.push(f"[::1]:{port}", [b"header", b"rows"], cached=cached)
        finally:
            sender.close()

    try:
        asyncio.run(push())
        assert pull.poll(30_000) and pull.recv_multipart() == [b"header", b"rows"]
    finally:
        pull.close(linger=0)
        ctx.term()


def test_without_the_ipv6_option_a_push_socket_never_reaches_an_ipv6_rank() -> None:
    """The control: why ZmqSender sets zmq.IPV6 (libzmq leaves it off)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.setsockopt(zmq.IPV6, 1)
    port = pull.bind_to_random_port("tcp://[::1]")
    push.setsockopt(zmq.IMMEDIATE, 1)
    push.connect(f"tcp://[::1]:{port}")
    try:
        assert not push.poll(2000, zmq.POLLOUT)  # no connection ever completes: nothing could be sent
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def test_all_sent_returns_only_once_every_send_has_ended() -> None:
    async def scenario() -> None:
        let_go = asyncio.Event()

        async def fails() -> None:
            raise ConnectionError("no such rank")

        async def still_reading() -> None:  # a send whose frames ZMQ still holds, as `drop` waits for them
            try:
                await let_go.wait()
            except asyncio.CancelledError:
                await let_go.wait()  # the frames are let go only then, cancelled or not
                raise

        sends = [asyncio.ensure_future(fails()), asyncio.ensure_future(still_reading())]
        waiting = asyncio.ensure_future(all_sent(sends))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # one failed, the other still reads: the rows stay held
        let_go.set()
        failed, ended = await waiting
        assert isinstance(failed, ConnectionError) and ended is None

        let_go.clear()
        send = asyncio.ensure_future(still_reading())
        waiting = asyncio.ensure_future(all_sent([send]))
        await asyncio.sleep(0.05)
        waiting.cancel()  # the caller is cancelled (Eric stopping, the client gone)
        await asyncio.sleep(0.05)
        assert not waiting.done()  # its send still reads the rows: the caller may not free them yet
        let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert send.cancelled()

    asyncio.run(scenario())


def _encode(ports: list[int]) -> EncodeRequest:
    return EncodeRequest(
        req_id="r", mm_items=["data:,"], num_parts=1, part_idx=0, prefill_host="192.0.2.1", embedding_port=ports
    )


def test_an_encode_names_each_port_once_and_at_most_max_ranks() -> None:
    policy = PeerPolicy(SglangConfig().peer_networks)
    checked = asyncio.run(policy.encode_target(_encode([7001, 7002, 7001]), "192.0.2.1"))
    assert checked.embedding_port == [7001, 7002]  # a rank is pushed the part once
    assert asyncio.run(policy.encode_target(_encode(list(range(1, MAX_RANKS + 1))), "192.0.2.1"))
    with pytest.raises(SglangError) as refused:
        asyncio.run(policy.encode_target(_encode(list(range(1, MAX_RANKS + 2))), "192.0.2.1"))
    assert refused.value.status == 400 and f"at most {MAX_RANKS} ranks" in refused.value.message
