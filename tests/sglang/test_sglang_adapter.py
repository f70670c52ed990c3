"""Eric behind SGLang 0.5.23's `--language-only --encoder-urls`: SGLang's own receiver classes, imported from the
installed sglang (never copied), against live Erics, for every encoder transfer SGLang has plus NIXL (our plugin).
The prefill side is eric_epd.testing.sglang_prefill (its docstring lists what is SGLang's and what stands in).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from eric_epd.testing.media import data_url, image_data_url, video_bytes
from eric_epd.testing.ports import refusing_url
from eric_epd.testing.sglang_prefill import BootstrapUrls, ParseArgs, ParsedArgs, WireCheck, unpack
from eric_epd.testing.stack import metric, wait_for
from tests.support import helpers_sglang
from tests.support.helpers_sglang import (
    ATOL,
    IMAGES,
    RTOL,
    SPLIT_IMAGES,
    STORED_IMAGES,
    check_equal,
    eric_tensors,
    items_counter,
    prompt_for,
)
from tests.support.sglang_probes import ELSEWHERE
from tests.support.sglang_video import qwen_vl_video_rows, sglang_prepared_frames

# the prefill harness's module-scoped fixtures: three Erics and the prefill host, started once for this module
bootstrap_port, setup, references = helpers_sglang.bootstrap_port, helpers_sglang.setup, helpers_sglang.references

README = Path(__file__).resolve().parents[2] / "eric_epd" / "plugins" / "sglang" / "README.md"


# ---------------------------------------------------------------------------------------------------- tests


def documented_commands() -> list[list[str]]:
    """The SGLang command lines in eric_epd/plugins/sglang/README.md."""
    import shlex

    return [
        shlex.split(line)[3:]
        for line in README.read_text().splitlines()
        if line.startswith("python -m sglang.launch_server")
    ]


def test_sglang_parser_accepts_documented_command_lines(setup, qwen2_vl_tiny: Path) -> None:
    prefill, _ = setup
    commands = documented_commands()
    assert len(commands) >= 5, "README lists the prefill command lines"
    seen = set()
    for argv in commands:
        argv = [str(qwen2_vl_tiny) if a == "/models/Qwen2.5-VL-7B-Instruct" else a for a in argv]
        parsed = prefill.call(ParseArgs([*argv, "--device", "cpu"]), ParsedArgs)  # this host has no GPU
        assert parsed.error is None, f"{argv}: {parsed.error}"
        assert parsed.language_only and not parsed.encoder_only
        seen.add(parsed.encoder_transfer_backend)
        if parsed.encoder_transfer_backend == "nixl":  # the plugin's flag resolves to SGLang's pull flow + NIXL
            assert (parsed.resolved_backend, parsed.nixl_env) == ("mooncake", "nixl")
        else:
            assert parsed.resolved_backend == parsed.encoder_transfer_backend and parsed.nixl_env == ""
        assert parsed.encoder_urls or parsed.encoder_bootstrap_port == 8997
    assert {"zmq_to_scheduler", "zmq_to_tokenizer", "mooncake", "nixl"} <= seen
    bad = prefill.call(
        ParseArgs(
            ["--model-path", str(qwen2_vl_tiny), "--language-only", "--encoder-transfer-backend", "carrier-pigeon"]
        ),
        ParsedArgs,
    )
    assert bad.error is not None and "SystemExit" in bad.error  # argparse still refuses unknown backends
    refused = prefill.call(
        ParseArgs(
            [
                "--model-path",
                str(qwen2_vl_tiny),
                "--encoder-only",
                "--device",
                "cpu",
                "--encoder-transfer-backend",
                "nixl",
            ]
        ),
        ParsedArgs,
    )
    assert refused.error is not None and "Eric" in refused.error


def test_part_message_is_the_embedding_data_sglang_sends(setup) -> None:
    prefill, _ = setup
    assert prefill.call(WireCheck(), str) == "ok"


def test_zmq_to_tokenizer_qwen2_vl(setup, references, qwen2_vl_tiny: Path) -> None:
    """Tokenizer-side receiver; SGLang's own local processing of the same images places the tokens the same way."""
    prefill, erics = setup
    urls = [image_data_url(*spec) for spec in IMAGES]
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen2_vl_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[erics["A"].url],
        images=urls,
        prompt=prompt_for(len(urls)),
        local_reference=True,
    )
    (outcome,) = result.outcomes
    check_equal(outcome, eric_tensors(erics["A"], urls), references["qwen2_vl"]["images"], torch.float16)
    local = result.local
    assert local is not None and local.grid["img_grid_thw"] == outcome.grid["img_grid_thw"]
    assert outcome.input_ids == local.input_ids  # the same placeholder expansion as SGLang's own preprocessing
    assert torch.equal(unpack(outcome.mrope), unpack(local.mrope))  # the same M-RoPE positions


@pytest.mark.parametrize(
    "backend,family",
    [("zmq_to_scheduler", "qwen2_5_vl"), ("mooncake", "qwen2_vl"), ("nixl", "qwen2_5_vl"), ("nixl", "qwen2_vl")],
)
def test_scheduler_ranks_tp2(
    setup, references, qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path, backend: str, family: str
) -> None:
    """Two TP ranks (receive_count 2, SGLang's gloo TP group) each end up holding Eric's rows."""
    prefill, erics = setup
    ckpt, eric, dtype = (
        (qwen2_vl_tiny, erics["A"], "auto") if family == "qwen2_vl" else (qwen2_5_vl_tiny, erics["B"], "float32")
    )
    urls = [image_data_url(*spec) for spec in IMAGES]
    result = prefill.job(
        kind="scheduler",
        model=str(ckpt),
        backend=backend,
        encoder_urls=[eric.url],
        images=urls,
        prompt=prompt_for(len(urls)),
        tp=2,
        dtype=dtype,
    )
    assert result.dispatch_error is None
    expected = eric_tensors(eric, urls)
    assert [o.rank for o in result.outcomes] == [0, 1]
    for outcome in result.outcomes:
        check_equal(
            outcome, expected, references[family]["images"], torch.float16 if dtype == "auto" else torch.float32
        )
        assert outcome.engine == {"nixl": "NixlLandingEngine", "mooncake": "MooncakeTransferEngine"}.get(backend, "")
    assert result.outcomes[0].input_ids == result.outcomes[1].input_ids


def test_zmq_to_scheduler_tp1_images_and_video(setup, references, qwen2_5_vl_tiny: Path) -> None:
    """One rank; an image part and a video part (num_parts 2, modality-ordered); Qwen2.5-VL video metadata. The
    video's rows are transformers' for the frames SGLang's own preprocess_video makes of it (SGLang serves
    Qwen2-VL and Qwen3-VL videos token for token in test_sglang_server.py); another video's rows are not."""
    prefill, erics = setup
    urls = [image_data_url(*spec) for spec in IMAGES[:2]]
    video = data_url(video_bytes(num_frames=8, width=56, height=56, fps=4, seed=5), "video/mp4")
    result = prefill.job(
        kind="scheduler",
        model=str(qwen2_5_vl_tiny),
        backend="zmq_to_scheduler",
        encoder_urls=[erics["B"].url],
        images=urls,
        videos=[video],
        prompt=prompt_for(2, 1),
        tp=1,
        dtype="float32",
    )
    (outcome,) = result.outcomes
    ref = references["qwen2_5_vl"]["images"]
    check_equal(outcome, eric_tensors(erics["B"], urls), (ref[0][:2], ref[1][:2]), torch.float32)
    [got] = [unpack(t) for t, m in zip(outcome.embeddings, outcome.modalities) if m == "VIDEO"]
    text = "<|vision_start|><|video_pad|><|vision_end|>"
    for seed, right in ((5, True), (6, False)):
        frames, _ = sglang_prepared_frames(video_bytes(num_frames=8, width=56, height=56, fps=4, seed=seed))
        rows, grid = qwen_vl_video_rows(qwen2_5_vl_tiny, frames, text)
        assert outcome.grid["video_grid_thw"] == [grid]
        assert torch.allclose(got, rows, rtol=RTOL, atol=ATOL) is right, f"video seed {seed}"
    assert outcome.extra["second_per_grid_ts"] == [1.0]  # temporal_patch_size 2 / the 2 fps HF assumes (SGLang's)
    assert outcome.modalities == ["IMAGE", "IMAGE", "VIDEO"]


def test_request_split_across_two_erics_is_reassembled_in_order(setup, references, qwen2_vl_tiny: Path) -> None:
    prefill, erics = setup
    a, c = erics["A"], erics["C"]
    urls = [image_data_url(*spec) for spec in SPLIT_IMAGES]
    before = (items_counter(a), items_counter(c))
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen2_vl_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[a.url, c.url],
        images=urls,
        prompt=prompt_for(len(urls)),
    )
    assert (items_counter(a) - before[0], items_counter(c) - before[1]) == (2, 2)  # num_parts 2: both Erics
    expected = eric_tensors(a, urls)
    check_equal(result.outcomes[0], expected, references["qwen2_vl"]["split"], torch.float16)
    sched = prefill.job(
        kind="scheduler",
        model=str(qwen2_vl_tiny),
        backend="mooncake",
        encoder_urls=[c.url, a.url],
        images=urls,
        prompt=prompt_for(len(urls)),
        tp=2,
    )
    for outcome in sched.outcomes:
        check_equal(outcome, expected, references["qwen2_vl"]["split"], torch.float16)


def test_an_item_another_eric_encoded_reaches_sglang_from_the_global_cache(setup, qwen2_vl_tiny: Path) -> None:
    """A encoded these images; C, asked by SGLang, takes them from the store the two share: C runs no batch for
    them, and SGLang's receiver holds A's rows."""
    prefill, erics = setup
    a, c = erics["A"], erics["C"]
    urls = [image_data_url(*spec) for spec in STORED_IMAGES]
    expected = eric_tensors(a, urls)
    # A puts every image and video it encodes: wait until all of them are in the store
    encoded = sum(metric(a.url, f'eric_items_total{{modality="{m}",source="encoded"}}') for m in ("image", "video"))
    assert wait_for(lambda: metric(a.url, 'eric_global_cache{event="puts"}') >= encoded), "A did not share"
    from_store = 'eric_items_total{modality="image",source="global"}'
    batches, hits = metric(c.url, "eric_batches_total"), metric(c.url, from_store)
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen2_vl_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[c.url],
        images=urls,
        prompt=prompt_for(len(urls)),
    )
    check_equal(result.outcomes[0], expected, None, torch.float16)
    assert metric(c.url, "eric_batches_total") == batches
    assert metric(c.url, from_store) == hits + len(urls)


def test_eric_registers_with_sglang_bootstrap(setup, references, qwen2_vl_tiny: Path) -> None:
    """C registered itself (--sglang-register-url); a prefill with no --encoder-urls dispatches to it."""
    prefill, erics = setup
    c = erics["C"]
    deadline = time.monotonic() + 30
    while c.url not in prefill.call(BootstrapUrls(), list[str]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.call(BootstrapUrls(), list[str]) == [c.url]
    urls = [image_data_url(*spec) for spec in IMAGES]
    result = prefill.job(
        kind="tokenizer",
        model=str(qwen2_vl_tiny),
        backend="zmq_to_tokenizer",
        encoder_urls=[],
        images=urls,
        prompt=prompt_for(len(urls)),
        use_bootstrap=True,
    )
    check_equal(result.outcomes[0], eric_tensors(c, urls), references["qwen2_vl"]["images"], torch.float16)
    assert httpx.get(c.url + "/health_generate", timeout=60).status_code == 200
    c.stop()  # a graceful stop unregisters
    assert prefill.call(BootstrapUrls(), list[str]) == []


def test_eric_down_or_frozen_fails_like_sglangs_own_encoder(setup, qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> None:
    """SGLang classifies encoder failures itself (receiver._extract_encoder_error): a refused connection is 502,
    a client timeout 504 "Encoder ... timeout", an encoder's error body gives its status and message. Eric down,
    Eric frozen and Eric refusing bad media land in exactly those places."""
    prefill, erics = setup
    with refusing_url() as down:
        urls = [image_data_url(*spec) for spec in IMAGES[:2]]
        common = {"model": str(qwen2_vl_tiny), "images": urls, "prompt": prompt_for(2)}

        tok = prefill.job(kind="tokenizer", backend="zmq_to_tokenizer", encoder_urls=[down], **common).outcomes[0]
        assert (tok.ok, tok.error_code) == (False, 503)
        assert tok.error_msg.startswith("The encoder did not return multimodal embeddings")

        sched = prefill.job(kind="scheduler", backend="zmq_to_scheduler", encoder_urls=[down], tp=1, **common)
        assert sched.outcomes[0].error_code == 502 and "Cannot connect" in sched.outcomes[0].error_msg

    frozen = erics["B"]
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        res = prefill.job(
            kind="scheduler",
            backend="mooncake",
            encoder_urls=[frozen.url],
            tp=2,
            env={"SGLANG_ENCODER_HTTP_TIMEOUT": "3"},
            **{**common, "model": str(qwen2_5_vl_tiny)},
        )
        for o in res.outcomes:  # the dispatch (/encode) or the rank's size pull, whichever SGLang saw first
            assert (o.ok, o.error_code) == (False, 504)
            assert re.fullmatch(
                r"Encoder (HTTP request|/scheduler_receive_meta_data) timeout \(3\.0s\)", o.error_msg
            ), o.error_msg
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)

    bad = {**common, "images": [urls[0], "data:image/png;base64,iVBORw0KGgo="]}
    res = prefill.job(kind="scheduler", backend="zmq_to_scheduler", encoder_urls=[erics["A"].url], tp=2, **bad)
    for o in res.outcomes:
        assert not o.ok and o.error_code == 400 and "item 1" in o.error_msg, (o.error_code, o.error_msg)


# -------------------- where Eric connects (hostile callers, without a prefill: test_sglang_hostile_callers.py)


def test_allowed_peer_lets_pushes_through(setup, references, qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> None:
    """SGLang's own receivers advertising 127.0.0.2 (SGLANG_HOST_IP) while calling from 127.0.0.1: refused by A
    before it encodes anything (SGLang's tokenizer reports any dispatch failure as its 503), served by B, whose
    --sglang-allowed-peer covers 127.0.0.2."""
    prefill, erics = setup
    urls = [image_data_url(*spec) for spec in IMAGES]
    elsewhere = {"SGLANG_HOST_IP": ELSEWHERE}
    before = items_counter(erics["A"])
    refused = prefill.job(
        kind="tokenizer",
        model=str(qwen2_vl_tiny),
        backend="zmq_to_tokenizer",
        env=elsewhere,
        encoder_urls=[erics["A"].url],
        images=urls,
        prompt=prompt_for(len(urls)),
    ).outcomes[0]
    assert not refused.ok and refused.error_code == 503, (refused.error_code, refused.error_msg)
    assert items_counter(erics["A"]) == before

    expected = eric_tensors(erics["B"], urls)
    tok = prefill.job(
        kind="tokenizer",
        model=str(qwen2_5_vl_tiny),
        backend="zmq_to_tokenizer",
        env=elsewhere,
        encoder_urls=[erics["B"].url],
        images=urls,
        prompt=prompt_for(len(urls)),
        dtype="float32",
    )
    check_equal(tok.outcomes[0], expected, references["qwen2_5_vl"]["images"], torch.float32)
    sched = prefill.job(
        kind="scheduler",
        model=str(qwen2_5_vl_tiny),
        backend="zmq_to_scheduler",
        env=elsewhere,
        encoder_urls=[erics["B"].url],
        images=urls,
        prompt=prompt_for(len(urls)),
        tp=1,
        dtype="float32",
    )
    check_equal(sched.outcomes[0], expected, references["qwen2_5_vl"]["images"], torch.float32)
