"""A discrete-event model of serving one traffic mix, built from a profile: Erics as FIFO servers (a fixed latency
plus image tokens over their saturated rate), engines as vLLM-style continuous batching (chunked prefill within a
token budget, decode steps whose time follows the profiled TPOT against batch and context), and for colocated
serving the engine's own encoder run inside the step that starts a request's prefill."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from eric_epd.planning.profiles import DecodePoint, EngineSide, EricPoint, Profile, Traffic


@dataclass(frozen=True)
class EricModel:
    """One Eric: `fixed_s` per request plus its image tokens at `tokens_per_s` (its saturated rate)."""

    fixed_s: float
    tokens_per_s: float

    @classmethod
    def from_points(cls, points: list[EricPoint], tokens_per_item: float, items_per_request: int) -> EricModel:
        """Saturated rate from the busiest point; the fixed part from the lone request's latency beyond its work."""
        rate = max(p.items_per_s for p in points) * tokens_per_item
        alone = min(points, key=lambda p: p.concurrency)
        return cls(max(alone.latency_p50_s - items_per_request * tokens_per_item / rate, 0.0), rate)

    def service_s(self, image_tokens: int) -> float:
        """Seconds from a request's turn to its embeddings."""
        return self.fixed_s + image_tokens / self.tokens_per_s


@dataclass(frozen=True)
class DecodeCurve:
    """TPOT against batch for requests decoding after prompts of `context` tokens."""

    context: int
    batches: tuple[int, ...]
    tpots: tuple[float, ...]

    def at(self, batch: int) -> float:
        """TPOT at `batch`, interpolated between the profiled batches (linear beyond the last two)."""
        b, t = self.batches, self.tpots
        if len(b) == 1 or batch <= b[0]:
            return t[0]
        if batch >= b[-1]:
            return t[-1] + (t[-1] - t[-2]) / (b[-1] - b[-2]) * (batch - b[-1])
        return float(np.interp(batch, b, t))


def decode_curves(points: list[DecodePoint]) -> tuple[DecodeCurve, ...]:
    """One curve per profiled context length, shortest first."""
    contexts = sorted({p.context_tokens for p in points})
    return tuple(
        DecodeCurve(
            c,
            tuple(p.batch for p in sorted(points, key=lambda p: p.batch) if p.context_tokens == c),
            tuple(p.tpot_s for p in sorted(points, key=lambda p: p.batch) if p.context_tokens == c),
        )
        for c in contexts
    )


@dataclass(frozen=True)
class EngineModel:
    """One engine: a step takes the TPOT of its b decoding requests (at least 1) at their mean context, plus `slope_s`
    per prefill token; a first token reaches its client `request_overhead_s` later (outside the engine: HTTP,
    tokenizing, detokenizing); with `encoder_s_per_token` > 0 it also encodes its requests' images (colocated)."""

    request_overhead_s: float
    slope_s: float
    curves: tuple[DecodeCurve, ...]
    encoder_s_per_token: float = 0.0
    max_batched_tokens: int = 2048
    max_seqs: int = 16

    @classmethod
    def from_side(cls, side: EngineSide, colocated: bool, max_batched_tokens: int, max_seqs: int) -> EngineModel:
        """Least squares over the prefill points; the decode points as measured, per context."""
        x = np.array([p.tokens for p in side.prefill], dtype=float)
        engine_timed = all(p.engine_seconds > 0 for p in side.prefill)
        y = np.array([p.engine_seconds if engine_timed else p.seconds for p in side.prefill], dtype=float)
        slope, intercept = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
        curves = decode_curves(side.decode)
        if engine_timed:  # outside the engine: HTTP, the chat template, tokenizing, detokenizing
            overhead = float(np.median([p.seconds - p.engine_seconds for p in side.prefill]))
        else:
            overhead = max(float(intercept) - curves[0].tpots[0], 0.0)
        return cls(
            overhead,
            max(float(slope), 0.0),
            curves,
            side.own_encoder_s_per_image_token if colocated else 0.0,
            max_batched_tokens,
            max_seqs,
        )

    def decode_step_s(self, batch: int, context: float = 0.0) -> float:
        """TPOT at `batch` for requests at a mean `context` tokens: linear in context between the shortest and the
        longest profiled contexts (and beyond the longest), the shortest's curve alone when only one was profiled."""
        short, long = self.curves[0], self.curves[-1]
        if long.context == short.context:
            return short.at(batch)
        t_short, t_long = short.at(batch), long.at(batch)
        frac = (max(context, short.context) - short.context) / (long.context - short.context)
        return max(t_short + (t_long - t_short) * frac, 0.0)


@dataclass
class Request:
    """One simulated request and the times it reached each stage."""

    arrival: float
    image_tokens: int
    prompt_tokens: int
    output_tokens: int
    ready: float = 0.0
    """when its embeddings exist (EPD: Eric done; colocated: on arrival)"""
    prefilled: int = 0
    first_token: float = 0.0
    finish: float = 0.0
    left: int = 0
    encoded: bool = False


def make_requests(traffic: Traffic, image_tokens: dict[int, int], n: int, seed: int) -> list[Request]:
    """n requests of the mix: Poisson arrivals at traffic.rate (all at 0 when rate is 0), sides drawn uniformly."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        if traffic.rate > 0:
            t += rng.expovariate(traffic.rate)
        tokens = sum(image_tokens[rng.choice(traffic.sides)] for _ in range(traffic.images_per_request))
        out.append(Request(t, tokens, traffic.prompt_tokens + tokens, traffic.output_tokens))
    return out


def run_erics(requests: list[Request], erics: list[EricModel]) -> None:
    """Each request in arrival order to the Eric that frees first (load-aware routing); sets `ready`."""
    free = [(0.0, i) for i in range(len(erics))]
    heapq.heapify(free)
    for r in sorted(requests, key=lambda r: r.arrival):
        at, i = heapq.heappop(free)
        r.ready = max(at, r.arrival) + erics[i].service_s(r.image_tokens)
        heapq.heappush(free, (r.ready, i))


def run_engine(requests: list[Request], engine: EngineModel) -> None:
    """Continuous batching over `requests` (by `ready` time): sets first_token and finish."""
    pending = sorted(requests, key=lambda r: r.ready)
    waiting: list[Request] = []
    running: list[Request] = []
    now, i = 0.0, 0
    while i < len(pending) or waiting or running:
        while i < len(pending) and pending[i].ready <= now:
            waiting.append(pending[i])
            i += 1
        if not waiting and not running:
            now = pending[i].ready
            continue
        now += _step(waiting, running, engine, now)


def _step(waiting: list[Request], running: list[Request], engine: EngineModel, now: float) -> float:
    """One engine step: every running request decodes a token, prefill chunks fill the rest of the token budget."""
    decoding = list(running)
    budget = engine.max_batched_tokens - len(decoding)
    chunks: list[tuple[Request, int]] = []
    for r in waiting:
        if budget <= 0 or len(decoding) + len(chunks) >= engine.max_seqs:
            break
        take = min(budget, r.prompt_tokens - r.prefilled)
        chunks.append((r, take))
        budget -= take
    prefill = sum(take for _, take in chunks)
    encode = sum(r.image_tokens for r, _ in chunks if not r.encoded) * engine.encoder_s_per_token
    context = float(np.mean([r.prompt_tokens + r.output_tokens - r.left for r in decoding])) if decoding else 0.0
    seconds = engine.decode_step_s(max(len(decoding), 1), context) + engine.slope_s * prefill
    seconds += encode
    end = now + seconds
    for r, take in chunks:
        r.encoded = True
        r.prefilled += take
        if r.prefilled >= r.prompt_tokens:
            waiting.remove(r)
            r.first_token, r.left = end + engine.request_overhead_s, r.output_tokens - 1
            running.append(r)
    for r in decoding:
        r.left -= 1
    for r in [r for r in running if r.left <= 0]:
        running.remove(r)
        r.finish = end + engine.request_overhead_s
    return seconds


@dataclass
class Outcome:
    """What a simulated run serves: percentiles in ms, throughput in req/s and output tokens/s, goodput in req/s."""

    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    request_goodput: float = 0.0


def outcome(requests: list[Request], ttft_slo_ms: float, tpot_slo_ms: float) -> Outcome:
    """Percentiles (p50, p99), throughput and goodput of finished requests."""
    ttft = np.array([(r.first_token - r.arrival) * 1e3 for r in requests])
    tpot = np.array([(r.finish - r.first_token) * 1e3 / max(r.output_tokens - 1, 1) for r in requests])
    span = max(r.finish for r in requests) - min(r.arrival for r in requests)
    good = int(np.sum((ttft <= ttft_slo_ms) & (tpot <= tpot_slo_ms)))
    pct = {"p50": 50, "p99": 99}
    return Outcome(
        {k: float(np.percentile(ttft, q)) for k, q in pct.items()},
        {k: float(np.percentile(tpot, q)) for k, q in pct.items()},
        len(requests) / span,
        sum(r.output_tokens for r in requests) / span,
        good / span,
    )


def tokens_per_item(profile: Profile) -> float:
    """Mean image tokens per item of the traffic the profile was measured with."""
    return sum(profile.image_tokens[s] for s in profile.traffic.sides) / len(profile.traffic.sides)
