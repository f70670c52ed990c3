"""The gateway's request rewriting without servers: media counting, the embeds rewrite, and when vLLM can place
Eric's embeddings of a video."""

from __future__ import annotations

import pytest
from epd_gateway.content import collect_media, vllm_can_place, with_embeddings
from epd_gateway.errors import GatewayError

from eric_epd.server.url_policy import UrlPolicy

POLICY = UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))


def _body() -> dict:
    return {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "and"},
            {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}},
        ]},
    ]}


def test_media_parts_are_counted_and_rewritten_to_keyed_embeds() -> None:
    body = _body()
    refs = collect_media(body, POLICY, max_items=4)
    assert [(r.message, r.part, r.modality) for r in refs] == [(1, 0, "image"), (1, 2, "video")]
    items = [{"hash": "a" * 64, "grid_thw": [1, 4, 6]}, {"hash": "b" * 64, "grid_thw": [2, 4, 4]}]
    out = with_embeddings(body, refs, items)
    assert out["messages"][1]["content"][0] == {
        "type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": "a" * 64}
    assert out["messages"][1]["content"][2] == {
        "type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]}, "uuid": "b" * 64}
    assert body == _body()  # the client's request is not modified
    with pytest.raises(GatewayError, match="too many media items"):
        collect_media(body, POLICY, max_items=1)


def test_vllm_places_videos_only_at_one_second_per_grid_step() -> None:
    assert vllm_can_place([{"hash": "a"}, {"hash": "b", "second_per_grid_ts": 1.0}])  # images, Qwen2-VL, 2 fps
    assert not vllm_can_place([{"hash": "b", "second_per_grid_ts": 2.0}])  # a 1 fps source: raw media instead
    assert not vllm_can_place([{"hash": "b", "second_per_grid_ts": 0.5}])
