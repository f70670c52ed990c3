"""The SGLang part table without servers: the parts one host's rank calls make before any /encode are bounded (one
host cannot fill the table and lock every prefill out), and a part's /encode takes it off that host's count."""

from __future__ import annotations

import pytest

from eric_epd.eric.config import SglangConfig
from eric_epd.eric.sglang.parts import PartTable, rank_quota
from eric_epd.eric.sglang.protocol import SglangError
from eric_epd.wire.sglang import EncodeRequest


def test_one_hosts_ranks_make_at_most_their_share_of_parts_waiting_for_an_encode() -> None:
    max_parts = 4096
    table = PartTable(None, SglangConfig(max_parts=max_parts))  # type: ignore[arg-type]  # nothing is released
    quota = rank_quota(max_parts)
    assert quota == 512 and rank_quota(4) == 64  # an eighth, but no fewer than 64 (a small table is all one host's)
    for i in range(quota):
        table.get(f"a{i}", rank="10.0.0.1")
    with pytest.raises(SglangError) as refused:
        table.get("a-more", rank="10.0.0.1")
    assert refused.value.status == 503 and "wait for their /encode" in refused.value.message
    assert table.get("b0", rank="10.0.0.2") is not None  # another host is not held back
    assert table.get("posted") is not None  # nor an /encode's own part
    assert table.get("a0", rank="10.0.0.1") is not None  # a part already made is found, not made again
    part = table.get("a1", rank="10.0.0.1")
    assert part is not None
    part.request = EncodeRequest(req_id="a1", mm_items=[], num_parts=1, part_idx=0)  # its /encode came
    assert table.get("a-more", rank="10.0.0.1") is not None  # so its host may make another
