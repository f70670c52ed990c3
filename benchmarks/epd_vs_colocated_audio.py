"""EPD against colocated vLLM on audio-heavy chat traffic (one 3-15 s clip and a short prompt a request), loaded by
`vllm bench serve --dataset-name custom_audio`, on a Qwen2-Audio checkpoint shaped like Qwen2-Audio-7B: its language
model is benchmarks' 7B shape (planning/costs.py), its audio tower keeps the released input geometry (128 mel bins,
30 s windows of 1,500 positions) at a depth and width whose cost per audio token over the language model's prefill
per token matches the released model's (`cost_ratios`, written to the results).

Both sides in float32 on the same cores, layouts as benchmarks/epd_vs_colocated.py's (the gateway sends every
request with audio to Eric: `--epd-min-items 1`). Each run has its own clips (no cache answers).
Writes benchmarks/results/epd_vs_colocated_audio.{json,png}.
Usage: python benchmarks/epd_vs_colocated_audio.py [--quick] [--rates 0.4,0.8,inf] [--runs 2] [--prompts 32]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from epd_report import pipeline_efficiency, plot, print_table, ratios  # sibling scripts on sys.path
from epd_series import OUTPUT_TOKENS, SLO, Series
from epd_sides import run_side
from epd_vs_colocated import RESULTS

from eric_epd.checkpoints.audio_families import AUDIO_FAMILIES, QWEN2_AUDIO, _qwen2_audio
from eric_epd.checkpoints.builtin import ensure_built
from eric_epd.checkpoints.saving import save_random_checkpoint
from eric_epd.testing.media import audio_bytes

logger = logging.getLogger("epd_vs_colocated_audio")
RATE = 16000
TEXT_7B = {
    "hidden_size": 1024,
    "intermediate_size": 5504,
    "num_hidden_layers": 7,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}
"""benchmarks' 7B-shaped language model (checkpoints/builtin.py's shaped7b)."""
AUDIO = {"d_model": 512, "encoder_layers": 4, "encoder_attention_heads": 8, "encoder_ffn_dim": 1536}
"""The scaled tower: see `cost_ratios`."""
RELEASED_TEXT = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
}
RELEASED_AUDIO = {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120}
"""Qwen2-Audio-7B's config.json (Qwen-7B and Whisper-large-v3's encoder)."""
POSITIONS = 1500
"""Tower positions per 30 s window; two per audio token (the average pool)."""


def prefill_flops_per_token(t: dict) -> float:
    """2 x the language model's per-layer weights (q, k, v, o and a gated MLP) x its depth."""
    kv = t["num_key_value_heads"] * t["head_dim"]
    per_layer = (
        t["hidden_size"] * (2 * t["num_attention_heads"] * t["head_dim"] + 2 * kv)
        + 3 * t["hidden_size"] * t["intermediate_size"]
    )
    return 2.0 * per_layer * t["num_hidden_layers"]


def encoder_flops_per_token(a: dict) -> float:
    """The tower's work per audio token: two positions, each through every layer's projections, MLP and attention
    scores over a full window."""
    w, f = a["d_model"], a["encoder_ffn_dim"]
    per_position = 2.0 * (4 * w * w + 2 * w * f) + 4.0 * POSITIONS * w
    return 2 * per_position * a["encoder_layers"]


def cost_ratios() -> dict[str, float]:
    """Prefill per token over the tower per audio token, released and shaped, and shaped over released."""
    released = prefill_flops_per_token(RELEASED_TEXT) / encoder_flops_per_token(RELEASED_AUDIO)
    shaped = prefill_flops_per_token(TEXT_7B) / encoder_flops_per_token(AUDIO)
    return {
        "released_prefill_over_encoder": released,
        "shaped_prefill_over_encoder": shaped,
        "shaped_over_released": shaped / released,
    }


def _shaped(tok, ids: dict[str, int], vocab: int, init_std: float):
    cfg, processor = _qwen2_audio(tok, ids, vocab, init_std)
    for k, v in AUDIO.items():
        setattr(cfg.audio_config, k, v)
    for k, v in TEXT_7B.items():
        setattr(cfg.text_config, k, v)
    cfg.text_config.layer_types = ["full_attention"] * TEXT_7B["num_hidden_layers"]  # derived at construction
    return cfg, processor


def shaped_checkpoint() -> Path:
    """The 7B-shaped Qwen2-Audio checkpoint, built once into the cache."""
    from transformers import AutoModelForMultimodalLM

    released = AUDIO_FAMILIES["qwen2_audio"].released
    return ensure_built(
        "qwen2_audio-shaped7b-v1",
        "config.json",
        lambda out: save_random_checkpoint(out, QWEN2_AUDIO, _shaped, AutoModelForMultimodalLM, released, 0, 0.02),
    )


def audio_series(tmp: Path, prompts: int) -> Series:
    """custom_audio JSONL per run: `prompts` fresh 16 kHz wav clips of 3-15 s."""
    path = tmp / "audio_{seed}.jsonl"

    def prepare(seed: int) -> None:
        rng = np.random.default_rng(seed + 1)
        clips = tmp / f"clips_{seed}"
        clips.mkdir(exist_ok=True)
        with Path(str(path).replace("{seed}", str(seed))).open("w") as out:
            for i in range(max(prompts, 4)):
                f = clips / f"{i}.wav"
                f.write_bytes(audio_bytes(int(rng.uniform(3, 15) * RATE), RATE, seed=(seed + 1) * 10_007 + i))
                out.write(json.dumps({"prompt": "What is said in this clip?", "audio": str(f)}) + "\n")

    dataset = [
        "--dataset-name",
        "custom_audio",
        "--dataset-path",
        str(path),
        "--enable-multimodal-chat",
        "--custom-output-len",
        str(OUTPUT_TOKENS),
    ]
    return Series("audio", "shaped7b", dataset, 1, prepare, limits={"audio": 1}, gateway_args=("--epd-min-items", "1"))


def main() -> None:
    """Both sides over the rates, the ratios and the JSON and PNG."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts, one run, rates 0.2 and all at once")
    ap.add_argument("--rates", default="0.4,0.8,inf", help="comma-separated requests/s ('inf': all at once)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per point")
    ap.add_argument("--runs", type=int, default=2, help="runs per point (medians and spread)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        args.prompts, args.runs, args.rates = 8, 1, "0.2,inf"
    args.rate_list = [float(r) for r in args.rates.split(",")]
    logs = RESULTS / "epd_vs_colocated_audio_logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    model = shaped_checkpoint()
    start = time.perf_counter()
    results: dict = {
        "slo_ms": SLO,
        "output_tokens": OUTPUT_TOKENS,
        "prompts_per_point": args.prompts,
        "runs": args.runs,
        "cpu_cores": os.cpu_count(),
        "dtype": "float32 (Eric and vLLM)",
        "cost_ratios": cost_ratios(),
        "series": {},
    }
    with tempfile.TemporaryDirectory(prefix="epd-audio-") as tmp:
        series = audio_series(Path(tmp), args.prompts)
        out: dict = {"checkpoint": "qwen2_audio shaped7b", "dataset": series.dataset}
        for side in ("colocated", "epd"):
            out[side] = run_side(side, series, model, args.rate_list, args, logs)
        out["ratios"] = ratios(out)
        out["pipeline_efficiency"] = pipeline_efficiency(out)
        results["series"]["audio"] = out
    results["wall_s"] = time.perf_counter() - start
    (RESULTS / "epd_vs_colocated_audio.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "epd_vs_colocated_audio.png")
    print_table(results)
    logger.info("cost ratios: %s", results["cost_ratios"])


if __name__ == "__main__":
    main()
