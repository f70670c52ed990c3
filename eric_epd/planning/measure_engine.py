"""The engine's side on one device share, measured through `vllm serve`'s OpenAI API: prefill time against prompt
length with the images as precomputed embeddings (random tensors of the model's width, so no encoder runs), TPOT
against the number of requests decoding together (after a short prompt and after one as long as the mix's), and
what the engine's own encoder adds per raw image."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import statistics
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path

import httpx
import torch

from eric_epd.common.prometheus import histogram_totals
from eric_epd.media.synthetic import image_data_url
from eric_epd.planning.profiles import DecodePoint, EngineSide, PrefillPoint, Traffic
from eric_epd.planning.servers import Endpoint
from eric_epd.wire.handoff import embedding_width

logger = logging.getLogger(__name__)
REPEATS = 3


def image_grid(model: Path, side: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a side x side image, as the checkpoint's Qwen-VL image processor resizes it."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    pre = json.loads((model / "preprocessor_config.json").read_text())
    cfg = json.loads((model / "config.json").read_text())["vision_config"]
    patch, merge = cfg.get("patch_size", 14), cfg.get("spatial_merge_size", 2)
    h, w = smart_resize(side, side, factor=patch * merge, min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"])
    return 1, h // patch, w // patch


def image_tokens(model: Path, side: int) -> int:
    """Language-model tokens of one side x side image."""
    merge = json.loads((model / "config.json").read_text())["vision_config"].get("spatial_merge_size", 2)
    t, h, w = image_grid(model, side)
    return t * h * w // (merge * merge)


class EngineProbe:
    """Requests to one `vllm serve` (prefix caching off, embeddings on) on the model `model`."""

    def __init__(self, vllm: Endpoint, model: Path, seed: int = 0) -> None:
        self.vllm, self.model = vllm, model
        self.width = embedding_width(json.loads((model / "config.json").read_text()), "image")
        self.seeds: Iterator[int] = count(seed * 1_000_003)
        self.name = httpx.get(vllm.url + "/v1/models", headers=vllm.headers, timeout=30).json()["data"][0]["id"]

    def embeds_part(self, side: int) -> dict:
        """An image_embeds part: a random [tokens, width] tensor (torch.save, base64) and its grid."""
        generator = torch.Generator().manual_seed(next(self.seeds))
        tensor = torch.randn(image_tokens(self.model, side), self.width, generator=generator) * 0.02
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        return {
            "type": "image_embeds",
            "image_embeds": {
                "image_embeds": base64.b64encode(buffer.getvalue()).decode(),
                "image_grid_thw": list(image_grid(self.model, side)),
            },
        }

    def image_part(self, side: int) -> dict:
        """A raw image part (a new random PNG as a data URL)."""
        return {"type": "image_url", "image_url": {"url": image_data_url(side, side, next(self.seeds))}}

    def body(self, parts: list[dict], max_tokens: int, stream: bool = False, words: int = 16) -> dict:
        """A chat request: the parts, then `words` words of text; greedy, `max_tokens` tokens, EOS ignored."""
        text = {"type": "text", "text": "Describe these images. " + "word " * words}
        return {
            "model": self.name,
            "messages": [{"role": "user", "content": [*parts, text]}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }

    def _prefill_totals(self) -> tuple[float, float]:
        """(sum, count) of vLLM's request_prefill_time: engine time from scheduling to first token."""
        return histogram_totals(self.vllm.url, "vllm:request_prefill_time_seconds")

    def timed(self, body: dict) -> tuple[float, float, int]:
        """(seconds at the client, seconds in the engine's prefill, prompt tokens) of one non-streaming request."""
        before = self._prefill_totals()
        t0 = time.perf_counter()
        r = httpx.post(self.vllm.url + "/v1/chat/completions", json=body, headers=self.vllm.headers, timeout=600)
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        after = self._prefill_totals()
        for _ in range(50):  # the request's stats land as it finishes, maybe just after the answer
            if after[1] > before[1]:
                break
            time.sleep(0.02)
            after = self._prefill_totals()
        return seconds, after[0] - before[0], int(r.json()["usage"]["prompt_tokens"])

    async def _stream_stamps(self, client: httpx.AsyncClient, body: dict) -> list[float]:
        stamps: list[float] = []
        async with client.stream("POST", self.vllm.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                    stamps.append(time.perf_counter())
        return stamps

    async def _decode_together(self, batch: int, output_tokens: int, words: int) -> float:
        """The median TPOT of `batch` requests started together, over the tokens after the last of them began to
        decode (before that, steps also hold the others' prefill)."""
        async with httpx.AsyncClient(timeout=600, headers=self.vllm.headers) as client:
            streams = await asyncio.gather(
                *(self._stream_stamps(client, self.body([], output_tokens, True, words)) for _ in range(batch))
            )
        start = max(s[0] for s in streams)
        windows = [w for w in ([t for t in s if t >= start] for s in streams) if len(w) > 2]
        return statistics.median((w[-1] - w[0]) / (len(w) - 1) for w in windows)

    async def _all_at_once(self, bodies: list[dict]) -> float:
        async with httpx.AsyncClient(timeout=1800, headers=self.vllm.headers) as client:
            start = time.perf_counter()
            for r in await asyncio.gather(
                *(client.post(self.vllm.url + "/v1/chat/completions", json=b) for b in bodies)
            ):
                r.raise_for_status()
            return time.perf_counter() - start

    def words_for(self, tokens: int) -> int:
        """Words of filler text that make a text-only prompt `tokens` long (two probes: the filler's tokens per word
        and the fixed part)."""
        fixed = self.timed(self.body([], 1, words=0))[2]
        per_word = (self.timed(self.body([], 1, words=200))[2] - fixed) / 200
        return max(round((tokens - fixed) / per_word), 0)

    def saturated(self, traffic: Traffic, requests: int, prompt_tokens: int) -> float:
        """Requests/s of `requests` text-only requests as long as the mix's prompts (`prompt_tokens`, images
        included) and its output, sent all at once: the engine's prefill and decode work without any media on its
        API server (embeddings in the request would be deserialized on the engine's own cores; EPD's connector
        loads them from shared memory)."""
        words = self.words_for(prompt_tokens)
        bodies = [self.body([], traffic.output_tokens, words=words) for _ in range(requests)]
        return requests / asyncio.run(self._all_at_once(bodies))

    def prompt_tokens(self, words: int) -> int:
        """Prompt tokens of a text-only request with `words` words of filler."""
        return self.timed(self.body([], 1, words=words))[2]

    def decode_point(self, batch: int, output_tokens: int, words: int = 16) -> DecodePoint:
        """`batch` text requests of `words` words of filler started together: the median of their TPOTs once all
        decode (median over REPEATS runs)."""
        runs = [asyncio.run(self._decode_together(batch, output_tokens, words)) for _ in range(REPEATS)]
        return DecodePoint(batch=batch, tpot_s=statistics.median(runs), context_tokens=self.prompt_tokens(words))


def _mix_prompt_tokens(prefill: list[PrefillPoint], traffic: Traffic) -> int:
    """Mean prompt tokens of the mix's requests: the measured points with all its images, over its sides."""
    full = [p.tokens for p in prefill[len(prefill) // len(traffic.sides) - 1 :: len(prefill) // len(traffic.sides)]]
    return round(sum(full) / len(full))


def measure_engine(
    vllm: Endpoint,
    model: Path,
    traffic: Traffic,
    batches: tuple[int, ...],
    saturation_requests: int = 16,
    seed: int = 0,
) -> EngineSide:
    """Prefill points for 0, 1 and images_per_request images of each side as embeddings; the own encoder's engine
    seconds per image token (raw images minus embeddings, same prompt) and its preprocessing's (the rest of the
    client's wait); a decode point per batch size after a short prompt and after one as long as the mix's;
    the requests/s of `saturation_requests` of the mix at once."""
    probe = EngineProbe(vllm, model, seed)
    probe.timed(probe.body([probe.image_part(traffic.sides[0])], 1))  # warm-up: first-call costs
    prefill: list[PrefillPoint] = []
    own: list[float] = []
    preprocess: list[float] = []
    for side in traffic.sides:
        for n in sorted({0, 1, max(traffic.images_per_request, 1)}):
            embeds = [probe.timed(probe.body([probe.embeds_part(side) for _ in range(n)], 1)) for _ in range(REPEATS)]
            point = PrefillPoint(
                tokens=embeds[0][2],
                seconds=statistics.median(e[0] for e in embeds),
                engine_seconds=statistics.median(e[1] for e in embeds),
            )
            prefill.append(point)
            if n:
                raw = [probe.timed(probe.body([probe.image_part(side) for _ in range(n)], 1)) for _ in range(REPEATS)]
                tokens = n * image_tokens(model, side)
                own.append((statistics.median(r[1] for r in raw) - point.engine_seconds) / tokens)
                preprocess.append(
                    (statistics.median(r[0] - r[1] for r in raw) - (point.seconds - point.engine_seconds)) / tokens
                )
    mix_tokens = _mix_prompt_tokens(prefill, traffic)
    decode = [
        probe.decode_point(b, max(traffic.output_tokens, 8), words)
        for words in (16, probe.words_for(mix_tokens))
        for b in batches
    ]
    side = EngineSide(
        prefill=prefill,
        decode=decode,
        own_encoder_s_per_image_token=max(statistics.median(own), 0.0),
        own_preprocess_s_per_image_token=max(statistics.median(preprocess), 0.0),
        saturated_requests_per_s=probe.saturated(traffic, saturation_requests, mix_tokens),
    )
    logger.info("engine: %s", side)
    return side
