"""Eric's audio path against transformers' and vLLM's, per core, in one run, on a checkpoint whose audio tower has
Qwen2-Audio's released geometry (Whisper-large-v3's width 1280, 20 heads, 128 mel bins, 30 s windows) at 4 of its 32
layers: clips of 3-15 s (16 kHz wav, fresh per run), items/s at concurrency 1 and 8.

- transformers: in process on the core, its processor (Whisper feature extractor) on decoded samples, then
  `Qwen2AudioForConditionalGeneration`'s forward up to the language model (stopped there by a hook), batches of 1 or 8.
- vLLM: `vllm serve --mm-encoder-only` on the core (processor and tower; embeddings to its example EC producer),
  chat requests with one `input_audio` part.
- Eric: `eric-epd serve` on the core (router, engine and worker), `/v1/encode` with one audio data: URL.
Writes benchmarks/results/eric_audio_encoder.{json,png}. Usage: python benchmarks/eric_audio_encoder.py [--runs 3]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from eric_vs_vllm_encoder import CONCURRENCIES, RESULTS, Target, plot, summarize, vllm_encoder_only

from eric_epd.checkpoints.audio_families import AUDIO_FAMILIES, QWEN2_AUDIO, _qwen2_audio
from eric_epd.checkpoints.builtin import ensure_built
from eric_epd.checkpoints.saving import save_random_checkpoint
from eric_epd.common.cpus import available_cpus, pin_process
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import audio_bytes

logger = logging.getLogger("eric_audio_encoder")
RATE = 16000
LAYERS = 4
"""Of the released tower's 32: every layer costs the same, so the ratios hold at any depth."""


def _shaped(tok, ids: dict[str, int], vocab: int, init_std: float):
    """The tiny family's config and processor with the audio tower at the released width, heads and FFN."""
    cfg, processor = _qwen2_audio(tok, ids, vocab, init_std)
    audio = cfg.audio_config
    audio.d_model, audio.encoder_attention_heads, audio.encoder_ffn_dim, audio.encoder_layers = 1280, 20, 5120, LAYERS
    return cfg, processor


def shaped_checkpoint() -> Path:
    """The benchmark's checkpoint, built once into the cache."""
    from transformers import AutoModelForMultimodalLM

    released = AUDIO_FAMILIES["qwen2_audio"].released
    return ensure_built(
        f"qwen2_audio-shaped-l{LAYERS}-v1",
        "config.json",
        lambda out: save_random_checkpoint(out, QWEN2_AUDIO, _shaped, AutoModelForMultimodalLM, released, 0, 0.02),
    )


class _StopError(Exception):
    """Raised at the language model's door: transformers' audio work is done."""


class Transformers:
    """transformers' own audio path in process: processor, then the model's forward until the language model."""

    name = "transformers"

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

        def stop(*_args, **_kwargs):
            raise _StopError

        self.model.model.language_model.register_forward_pre_hook(stop, with_kwargs=True)

    def items_per_s(self, clips: list[bytes], concurrency: int) -> float:
        """Decode, featurize and encode the clips in batches of `concurrency`; items per wall second."""
        import soundfile

        start = time.perf_counter()
        for i in range(0, len(clips), concurrency):
            waves = [soundfile.read(_io(c), dtype="float32")[0] for c in clips[i : i + concurrency]]
            text = ["<|audio_bos|><|AUDIO|><|audio_eos|>"] * len(waves)
            inputs = self.processor(text=text, audio=waves, sampling_rate=RATE, return_tensors="pt", padding=True)
            with torch.no_grad(), contextlib.suppress(_StopError):
                self.model(**inputs)
        return len(clips) / (time.perf_counter() - start)


def _io(data: bytes):
    import io

    return io.BytesIO(data)


def _data_url(clip: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(clip).decode()


def eric_body(urls: list[str]) -> dict:
    """Eric's encode request for the clips."""
    return {"items": [{"modality": "audio", "url": u} for u in urls]}


def chat_body(name: str):
    """An OpenAI chat request with the clips as input_audio parts and one output token."""

    def body(urls: list[str]) -> dict:
        parts = [{"type": "input_audio", "input_audio": {"data": u.split(",", 1)[1], "format": "wav"}} for u in urls]
        return {
            "model": name,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Transcribe."}]}],
        }

    return body


def clips_for(run: int, count: int) -> list[bytes]:
    """`count` fresh 16 kHz mono wav clips of 3-15 s."""
    rng = np.random.default_rng(1000 + run + 1)
    return [audio_bytes(int(rng.uniform(3, 15) * RATE), RATE, seed=1000 * (run + 1) + i) for i in range(count)]


def run(args: argparse.Namespace, logs: Path) -> dict[str, dict[int, list[float]]]:
    """Every path at each concurrency, taking turns within each run; items/s per run."""
    cpus = available_cpus()
    core, client = cpus[-1], cpus[0]
    model = shaped_checkpoint()
    rates: dict[str, dict[int, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        store = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        vllm = stack.enter_context(vllm_encoder_only(model, "float32", core, store, logs / "vllm.log"))
        name = httpx.get(vllm.url + "/v1/models", headers=vllm.headers, timeout=30).json()["data"][0]["id"]
        eric = stack.enter_context(
            EricServer(model, extra_args=("--dtype", "float32"), cpus=(core,), log_path=logs / "eric.log")
        )
        served = [
            Target("vllm", vllm, "/v1/chat/completions", chat_body(name)),
            Target("eric", eric, "/v1/encode", eric_body),
        ]
        pin_process((core,))
        torch.set_num_threads(1)
        hf = Transformers(model)
        warm = clips_for(-1, 2)
        hf.items_per_s(warm, 1)
        pin_process((client,))
        for target in served:
            target.images_per_s([[_data_url(c)] for c in warm], 1)
        for r in range(args.runs):
            for c in CONCURRENCIES:
                clips = clips_for(r * 10 + c, args.requests)
                pin_process((core,))
                rates.setdefault("transformers", {}).setdefault(c, []).append(hf.items_per_s(clips, c))
                pin_process((client,))
                for target in served:
                    rates.setdefault(target.name, {}).setdefault(c, []).append(
                        target.images_per_s([[_data_url(clip)] for clip in clips], c)
                    )
                logger.info("run %d, concurrency %d: %s", r, c, {n: round(v[c][-1], 2) for n, v in rates.items()})
    return rates


def main() -> None:
    """Parse the flags, measure, write the JSON and the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="clips per point (one clip a request)")
    parser.add_argument("--runs", type=int, default=3, help="runs (each measures every path at each concurrency)")
    parser.add_argument("--quick", action="store_true", help="one run of 8 clips per point")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.requests = 1, 8
    logs = RESULTS / "eric_audio_encoder_logs"
    logs.mkdir(parents=True, exist_ok=True)
    rates = run(args, logs)
    vs_transformers = {
        name: {c: float(np.median(v[c]) / np.median(rates["transformers"][c])) for c in CONCURRENCIES}
        for name, v in rates.items()
    }
    summary = summarize(rates)
    title = (
        f"Qwen2-Audio tower at released width, {LAYERS} layers, float32, one 3-15 s clip a request, "
        f"one core each, {args.runs} runs"
    )
    result = {
        "what": title,
        "concurrencies": list(CONCURRENCIES),
        "paths": summary,
        "vs_transformers": vs_transformers,
        "transformers": "processor + forward to the language model, in process, batches of the concurrency",
        "vllm": "vllm serve --mm-encoder-only (processor + tower; ECExampleConnector producer)",
        "eric": "eric-epd serve (router, engine, worker on the same core)",
    }
    (RESULTS / "eric_audio_encoder.json").write_text(json.dumps(result, indent=2))
    plot(summary, RESULTS / "eric_audio_encoder.png", title, unit="clips")
    for name, cells in summary.items():
        logger.info(
            "%s: %s", name, {c: (round(v["median"], 2), round(v.get("vs_vllm", 1), 2)) for c, v in cells.items()}
        )
    logger.info("vs transformers: %s", vs_transformers)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    main()
