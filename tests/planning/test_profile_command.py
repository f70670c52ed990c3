"""`eric-epd profile` on a real Eric and a real `vllm serve` (tiny Qwen2.5-VL, one core), then `eric-epd plan` on what
it wrote: the engine took the random embeddings as image tokens (the prompt lengths vLLM reports), every figure is
measured (Eric's host and tower seconds per item too), and the plan answers for both modes and shows that split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.common.cpus import available_cpus
from eric_epd.planning.profiles import read_profile


def test_profile_then_plan(tmp_path: Path) -> None:
    model = ensure_checkpoint("qwen2_5_vl", "tiny")
    out = tmp_path / "profile.json"
    core = str(available_cpus()[0])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "eric_epd",
            "profile",
            "--model",
            str(model),
            "--out",
            str(out),
            "--share",
            core,
            "--images",
            "2",
            "--sides",
            "112,224",
            "--concurrency",
            "1,4",
            "--batches",
            "1,4",
            "--requests",
            "4",
            "--output-tokens",
            "8",
            "--max-model-len",
            "4096",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        check=True,
        timeout=900,
    )
    profile = read_profile(out)
    assert profile.image_tokens == {112: 16, 224: 64}
    assert profile.token_factor == 28
    (share,) = profile.shares
    assert share.devices == (int(core),)
    assert [p.concurrency for p in share.eric] == [1, 4]
    assert all(p.items_per_s > 0 and 0 < p.latency_p50_s <= p.latency_p99_s and p.batch_items >= 1 for p in share.eric)
    assert all(p.host_s_per_item > 0 and p.tower_s_per_item > 0 for p in share.eric)  # eric_stage_seconds' split
    prefill = share.engine.prefill
    assert len(prefill) == 6  # 0, 1 and 2 images of each side
    text_only = prefill[0].tokens
    # each image: its embeddings' rows and the vision start and end tokens, as vLLM counted them
    assert [p.tokens - text_only for p in prefill] == [0, 18, 36, 0, 66, 132]
    assert all(0 < p.engine_seconds < p.seconds for p in prefill)  # vLLM's prefill phase is within the wait
    decode = share.engine.decode
    assert [d.batch for d in decode] == [1, 4, 1, 4] and all(d.tpot_s > 0 for d in decode)
    # the text-only prompt, then one as long as the mix's (text, plus every image's rows and its two markers)
    short, mix = decode[0].context_tokens, decode[2].context_tokens
    assert decode[1].context_tokens == short == text_only and decode[3].context_tokens == mix
    assert abs(mix - (prefill[2].tokens + prefill[5].tokens) / 2) <= 3
    assert share.engine.own_encoder_s_per_image_token >= 0
    assert share.engine.saturated_requests_per_s > 0
    plan_json = tmp_path / "plan.json"
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "eric_epd",
            "plan",
            "--profile",
            str(out),
            "--devices",
            "2",
            "--ttft-ms",
            "2000",
            "--tpot-ms",
            "100",
            "--rate",
            "4",
            "--images",
            "2",
            "--sides",
            "112,224",
            "--requests",
            "40",
            "--seeds",
            "2",
            "--json",
            str(plan_json),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "EPD (best): 1 Eric x1 + 1 engine x1" in table and "colocated: 2 engine x1" in table
    assert "share of 1 cpu device(s): host " in table and "not measured" not in table
    result = json.loads(plan_json.read_text())
    for mode in ("epd", "colocated"):
        assert result[mode]["request_throughput"] > 0
        assert result[mode]["ttft_ms"]["p50"] <= result[mode]["ttft_ms"]["p99"]
    assert set(result["ratios"]) == {"throughput", "ttft_p50", "tpot_p99", "goodput"}
