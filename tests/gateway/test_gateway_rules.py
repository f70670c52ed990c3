"""The gateway's request rewriting without servers: media counting, the embeds rewrite, when vLLM can place
Eric's embeddings of a video, and which media count toward --epd-min-items."""

from __future__ import annotations

import base64
import io
import json

import msgspec
import numpy as np
import pytest
import torch
from epd_gateway.boundary import CHAT_FIELDS, COMPLETION_FIELDS, STEERING_FIELDS, check_messages, check_request_fields
from epd_gateway.content import collect_media, inlined_refs, vllm_can_place, with_embeddings
from epd_gateway.embeds import EmbeddingShape, check_embeds_parts
from epd_gateway.plain_media import PlainMedia

from eric_epd.common.errors import ApiError
from eric_epd.media.url_policy import UrlPolicy
from eric_epd.testing.media import image_data_url
from eric_epd.wire.handoff import EXTRA_ARGS_KEY
from tests.support.encoded import encoded

POLICY = UrlPolicy(host_allowlist=frozenset({"127.0.0.1"}))
PNG_URL = image_data_url(4, 4)
"""A data: URL the gateway takes for an image (it checks each data: URL's medium)."""


def _body() -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": PNG_URL}},
                    {"type": "text", "text": "and"},
                    {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}},
                ],
            },
        ],
    }


def test_media_parts_are_counted_and_rewritten_to_keyed_embeds() -> None:
    body = _body()
    refs = collect_media(body, POLICY, max_items=4)
    assert [(r.message, r.part, r.modality) for r in refs] == [(1, 0, "image"), (1, 2, "video")]
    items = [encoded(h, g) for h, g in (("a", [1, 4, 6]), ("b", [2, 4, 4]))]
    out = with_embeddings(body, refs, items)
    handles = json.loads(out["vllm_xargs"][EXTRA_ARGS_KEY])  # beside the request, not inside the uuid
    assert [h["lease"] for h in handles] == ["token-a", "token-b"]
    assert out["messages"][1]["content"][0] == {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 4, 6]},
        "uuid": "a" * 64,
    }
    assert out["messages"][1]["content"][2] == {
        "type": "video_embeds",
        "video_embeds": {"video_grid_thw": [2, 4, 4]},
        "uuid": "b" * 64,
    }
    assert body == _body()  # the client's request is not modified
    with pytest.raises(ApiError, match="too many media items"):
        collect_media(body, POLICY, max_items=1)


def test_items_placed_by_their_media_keep_the_inlined_part_with_the_hash_as_uuid() -> None:
    """The generic path: the part stays the media (the inlined body's data: URL, never the client's URL) and gains
    the uuid; a grid-placed item beside it still becomes a metadata-only part."""
    body = _body()
    refs = collect_media(body, POLICY, max_items=4)
    inlined = json.loads(json.dumps(body))
    inlined["messages"][1]["content"][2]["video_url"]["url"] = "data:application/octet-stream;base64,BBBB"
    sent = inlined_refs(inlined, refs)
    assert [r.url for r in sent] == [PNG_URL, "data:application/octet-stream;base64,BBBB"]
    assert [(r.message, r.part, r.modality) for r in sent] == [(r.message, r.part, r.modality) for r in refs]
    items = [encoded("a", [1, 1, 4], placement="media"), encoded("b", [2, 4, 4])]
    out = with_embeddings(inlined, refs, items)
    assert out["messages"][1]["content"][0] == {"type": "image_url", "image_url": {"url": PNG_URL}, "uuid": "a" * 64}
    assert out["messages"][1]["content"][2] == {
        "type": "video_embeds",
        "video_embeds": {"video_grid_thw": [2, 4, 4]},
        "uuid": "b" * 64,
    }
    assert [h["lease"] for h in json.loads(out["vllm_xargs"][EXTRA_ARGS_KEY])] == ["token-a", "token-b"]
    items[1] = msgspec.structs.replace(items[1], placement="media")
    kept = with_embeddings(inlined, refs, items)["messages"][1]["content"][2]
    assert kept == {
        "type": "video_url",
        "video_url": {"url": "data:application/octet-stream;base64,BBBB"},
        "uuid": "b" * 64,
    }


def test_vllm_places_videos_only_at_one_second_per_grid_step() -> None:
    assert vllm_can_place([encoded("a"), encoded("b", second_per_grid_ts=1.0)])  # images, Qwen2-VL, 2 fps
    assert not vllm_can_place([encoded("b", second_per_grid_ts=2.0)])  # a 1 fps source: raw media instead
    assert not vllm_can_place([encoded("b", second_per_grid_ts=0.5)])


def _refused(body: dict, match: str, allow_embeddings: bool = False) -> None:
    with pytest.raises(ApiError, match=match) as e:
        check_request_fields(body, chat=True)
        check_messages(body, allow_embeddings)
    assert e.value.status == 400


def _user(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def test_parts_carry_only_their_own_keys() -> None:
    check_messages(_body(), allow_embeddings=False)
    url = {"url": "http://127.0.0.1:9/a.png"}
    _refused(_user({"type": "image_url", "image_url": url, "uuid": "a" * 64}), "'uuid' is not accepted")
    _refused(_user({"type": "text", "text": "x", "image_url": url}), r"unexpected field\(s\) \['image_url'\]")
    _refused(_user({"type": "image_url", "image_url": {**url, "uuid": "x"}}), "unexpected field")
    _refused(_user({"type": "image_embeds", "image_embeds": {}}), "client embeddings are off")
    _refused(_user({"type": "image_embeds", "image_embeds": {}, "uuid": "a"}), "uuid", allow_embeddings=True)
    _refused(_user({"type": "file", "file": {}}), "unsupported content part type 'file'")
    _refused(_user({"type": ["image_url"], "image_url": url}), r"unsupported content part type \['image_url'\]")
    _refused(_user({"type": {"a": 1}}), "unsupported content part type {'a': 1}")  # no 500: a dict is unhashable
    _refused({"messages": [{"role": "user", "content": "x", "image_url": url}]}, "unexpected field")
    _refused({"messages": [{"role": "user", "content": {"type": "text"}}]}, "string or a list")
    for name in STEERING_FIELDS:  # mm_processor_kwargs: chat requests may carry its one option
        _refused({"messages": [{"role": "user", "content": "x"}], name: 1}, f"'{name}' (is not accepted|may only)")


def test_request_fields_by_an_allowlist() -> None:
    """Every field vLLM 0.32's chat and completion requests take is either allowed or refused; fields it does not
    steer with pass; a field neither list names (say one a newer vLLM adds) is refused."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "temperature": 0.0,
        "max_tokens": 4,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    check_request_fields(chat, chat=True)
    check_request_fields({**chat, "use_beam_search": False}, chat=True)
    for stream in ("false", 0, "no"):  # the gateway would stream what the engine answers whole (null is false)
        with pytest.raises(ApiError, match="'stream' must be true or false"):
            check_request_fields({**chat, "stream": stream}, chat=True)
    with pytest.raises(ApiError, match="use_beam_search is not accepted"):  # it drops the hand-offs the gateway adds
        check_request_fields({**chat, "use_beam_search": True}, chat=True)
    check_request_fields({"model": "m", "prompt": "x", "max_tokens": 4, "echo": False, "suffix": "y"})
    for name in (
        "mm_payload",
        "return_mm_kwargs",
        "session_id",
        "routed_experts_prompt_start",
        "stream_interval",
        "watermarking",
        "logits_processors",
        "a_field_from_the_future",
    ):
        _refused({"messages": [{"role": "user", "content": "x"}], name: 1}, f"'{name}' is not accepted")
    for kind, allowed in ((ChatCompletionRequest, CHAT_FIELDS), (CompletionRequest, COMPLETION_FIELDS)):
        for name in kind.model_fields:
            body = {"model": "m", name: None}
            if name in allowed:
                check_request_fields(body, chat=kind is ChatCompletionRequest)
            elif name != "mm_processor_kwargs":
                with pytest.raises(ApiError):
                    check_request_fields(body, chat=kind is ChatCompletionRequest)
    with pytest.raises(ApiError, match="'messages' is not accepted"):
        check_request_fields({"model": "m", "messages": []})  # a chat field on /v1/completions


def _b64(array: np.ndarray, as_torch: bool) -> str:
    buffer = io.BytesIO()
    if as_torch:
        torch.save(torch.from_numpy(array), buffer)
    else:
        np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def test_client_embeddings_checked_against_grid_and_width() -> None:
    shape = EmbeddingShape(width=8, merge=2)
    grid = [1, 4, 6]  # 24 patches -> 6 rows

    def part(data: str, g: list = grid) -> dict:
        return _user({"type": "image_embeds", "image_embeds": {"image_embeds": data, "image_grid_thw": g}})

    for as_torch in (True, False):
        check_embeds_parts(part(_b64(np.zeros((6, 8), np.float32), as_torch)), shape)
        for bad in (np.zeros((5, 8), np.float32), np.zeros((6, 9), np.float32), np.zeros((6, 8), np.int64)):
            with pytest.raises(ApiError, match="image_embeds"):
                check_embeds_parts(part(_b64(bad, as_torch)), shape)
    for data, g in (
        ("not base64!", grid),
        (_b64(np.zeros((6, 8), np.float32), True), [1, 4, 5]),
        (_b64(np.zeros((6, 8), np.float32), True), [1, -4, 6]),
        (base64.b64encode(b"\x80\x04K\x01.").decode(), grid),
    ):  # a pickle, refused
        with pytest.raises(ApiError):
            check_embeds_parts(part(data, g), shape)


def test_recommended_encoders_on_recorded_loads() -> None:
    """scaling.py's formula on load reports as Erics answer them (numbers recorded from this project's runs)."""
    from epd_gateway.scaling import recommended_encoders

    from eric_epd.wire.load import LoadReport

    idle = [LoadReport(0, 0.04, 1.2, 0.05, 30.0), LoadReport(0, 0.02, 0.6, 0.04, 30.0)]
    assert recommended_encoders(idle, healthy=2) == 1  # two Erics at 3% busy: one would do
    steady = [LoadReport(3, 0.93, 9.5, 1.8, 30.0), LoadReport(2, 0.88, 9.1, 1.6, 30.0)]
    assert recommended_encoders(steady, healthy=2) == 3  # 1.81 Erics of work at 70% each: 3; backlog 0.3 s
    exact = [LoadReport(0, 0.7, 5.0, 0.5, 30.0), LoadReport(0, 0.7, 5.0, 0.5, 30.0)]
    assert recommended_encoders(exact, healthy=2) == 2  # exactly at target: no flapping up
    piling = [LoadReport(120, 0.99, 20.0, 9.0, 30.0), LoadReport(95, 1.0, 21.0, 9.5, 30.0)]
    assert recommended_encoders(piling, healthy=2) == 3  # backlog 5.2 s > 2 s: at least one more
    stuck = [LoadReport(40, 0.0, 0.0, 0.0, 30.0)]
    assert recommended_encoders(stuck, healthy=1) == 2  # queued work and nothing finishing
    assert recommended_encoders([], healthy=3) == 3  # no report yet: no signal, no change


def test_items_go_to_their_holder_else_to_a_much_sooner_start() -> None:
    """EncoderPool.choose: an item goes back to the Eric that answered it; a new item to its rendezvous Eric unless
    by the Erics' load reports another starts it over 0.5 s sooner; without reports, rendezvous alone."""
    import httpx
    from epd_gateway.encoders import EncoderPool
    from epd_gateway.metrics import GatewayMetrics

    from eric_epd.wire.load import LoadReport

    pool = EncoderPool(("http://a:1", "http://b:1"), httpx.AsyncClient(), None, GatewayMetrics(), 2, 5.0)
    key = b"image-1"
    first = pool.preference(key, set())[0]
    other = next(m for m in pool.healthy() if m is not first)
    assert pool.choose(key, set()) is first  # no reports: rendezvous
    for member in (first, other):  # the gateway saw each answer 100 items: their 10 items/s are believed
        member.completed.add(100)
    first.load, other.load = LoadReport(3, 0.9, 10.0, 1.0, 30.0), LoadReport(0, 0.1, 10.0, 0.2, 30.0)
    assert pool.choose(key, set()) is first  # 0.3 s longer wait: within the slack, the content's own Eric keeps it
    first.load = LoadReport(40, 1.0, 10.0, 5.0, 30.0)
    assert pool.choose(key, set()) is other  # 4 s of queue there: the idle Eric starts it sooner
    pool.remember(key, first.url)
    assert pool.choose(key, set()) is first  # it holds the embedding: back there, whatever the queue
    assert pool.choose(key, {first.url}) is other  # unless it is excluded (it failed this item)
    first.healthy = False
    assert pool.choose(key, set()) is other


def test_load_reports_are_bounded_and_checked_against_what_the_gateway_sees() -> None:
    """loadcheck.believed_load: every field clamped (not-finite: 0), the queue at least the items in flight from the
    gateway, items/s at most 4 times what the gateway saw the Eric answer (at least 1 item/s)."""
    from epd_gateway.loadcheck import MAX_QUEUE, believed_load

    from eric_epd.wire.load import LoadReport

    absurd = believed_load(LoadReport(0, 7.0, 1e12, float("inf"), -5.0), inflight_items=12, observed_per_s=0.0)
    assert absurd == LoadReport(12, 1.0, 4.0, 0.0, 0.0)
    assert believed_load(LoadReport(10**12, float("nan"), 50.0, 0.5, 30.0), 0, 100.0) == LoadReport(
        MAX_QUEUE, 0.0, 50.0, 0.5, 30.0
    )
    assert believed_load(LoadReport(-3, 0.5, -1.0, 0.1, 30.0), 2, 5.0) == LoadReport(2, 0.5, 0.0, 0.1, 30.0)


def test_media_the_plain_path_carried_do_not_count_and_the_memory_is_bounded() -> None:
    refs = collect_media(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_data_url(4, 4, seed=n)}} for n in range(4)
                    ],
                }
            ]
        },
        POLICY,
        8,
    )
    seen = PlainMedia(capacity=3)
    assert seen.unseen(refs) == 4
    seen.remember(refs[:2])
    assert seen.unseen(refs) == 2 and seen.unseen(refs[:2]) == 0
    seen.remember(refs[2:])  # four keys into three: the least recently seen (refs[0]) goes
    assert seen.unseen(refs) == 1 and seen.unseen(refs[:1]) == 1


def test_the_hosts_to_check_are_read_from_each_urls_head() -> None:
    """remote_hosts parses no more of a URL than a fetchable one may hold: a data: URL of megabytes names no host,
    and an http(s) URL's host and port come out as urlsplit reads them (scheme in any case, blanks before it)."""
    from epd_gateway.content import MediaRef, remote_hosts

    refs = [
        MediaRef(0, 0, "image", "data:image/png;base64," + "A" * (8 << 20)),
        MediaRef(0, 1, "image", " HTTP://Example.com:8080/x.png"),
        MediaRef(0, 2, "image", "https://b.test/y"),
    ]
    assert remote_hosts(refs) == {("example.com", 8080), ("b.test", 443)}
