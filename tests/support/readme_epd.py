"""The README's passages on the EPD-against-colocated runs (benchmarks/epd_vs_colocated*.py) built from their JSON,
one function per passage, for tests/project/test_readme_figures.py: the shaped runs and the planner's error, the
--quick and multi-turn runs, the audio run, and docs/planning.md's summary over both shaped runs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import readme_planner as planner
from tests.support.readme_figures import eric_core_s, f2, span, x

ROOT = Path(__file__).resolve().parents[2]


def mix(d: dict) -> dict:
    """The shaped runs' one series."""
    return d["series"]["mix"]


def saturated(d: dict, side: str) -> float:
    """A side's measured throughput all at once (median of the runs)."""
    return mix(d)[side]["points"]["inf"]["request_throughput"]["median"]


def ratios(d: dict, key: str) -> list[float]:
    """EPD / colocated of one measure at every rate where both sides measured it."""
    return [r[key] for r in mix(d)["ratios"].values() if r[key] is not None]


def cost(d: dict, key: str) -> str:
    """The run's cost check (from the profile taken before the runs)."""
    return f2(mix(d)["cost_check"][key])


def cost_check(d: dict) -> str:
    """The rows' cost check: FLOPs, then measured against Eric and vLLM's encoder."""
    return (
        f"Cost check (the run's profile): prefill / tower per image token {cost(d, 'flops_prefill_over_encoder')} in "
        f"FLOPs, {cost(d, 'measured_prefill_over_eric')} measured against Eric, "
        f"{cost(d, 'measured_prefill_over_vllm_encoder')} against vLLM's encoder"
    )


STRICT = (
    "counted strictly: a figure is a hit only within 15% of the median; a miss inside the {runs} runs' min-max is "
    "shown, not counted"
)


def predictions(d: dict) -> dict:
    """The committed predictions file the run compared with (written by `eric-epd plan --rates`)."""
    return json.loads((ROOT / mix(d)["predictions_file"]).read_text())


def predicted_before(d: dict) -> str:
    """Where the predictions came from and when, against when the runs started."""
    s, first = mix(d), predictions(d)
    return (
        f"`eric-epd plan --rates` predicted every point from the profile the run took first, {first['seeds']} "
        f"simulated seeds of {first['requests']} requests, and the predictions were committed before the runs "
        f"(`{s['predictions_file']}`, made {first['made_at'][:16].replace('T', ' ')} UTC; the runs started "
        f"{s['colocated']['started_at'][:16].replace('T', ' ')})"
    )


def planner_row(d: dict) -> str:
    """A shaped row's planner passage and target cell: the errors, strictly counted, then the cost check."""
    s = mix(d)
    return (
        f"Planner against measured medians, {STRICT.format(runs=d['runs'])}. {predicted_before(d)}: "
        f"{planner.accuracy(s, '')}. {cost_check(d)} | planner within 15%: {planner.per_measure(s, '')}"
    )


def shaped_row(d: dict) -> str:
    """A shaped run's row: the ratios' ranges, the pipeline efficiency, then planner_row."""
    return (
        f"throughput {span(ratios(d, 'request_throughput'), x)}, TPOT p99 {span(ratios(d, 'p99_tpot_ms'), x)}, "
        f"goodput {span(ratios(d, 'request_goodput'), x)}, TTFT p50 "
        f'{span(ratios(d, "p50_ttft_ms"), lambda v: f"{v:.1f}x")} (table in "Does EPD pay?"); pipeline efficiency '
        f"{f2(mix(d)['pipeline_efficiency'])}. {planner_row(d)}"
    )


def widest(d: dict, key: str) -> tuple[str, str, dict]:
    """The measured point of `key` whose runs spread widest (relative to the median): side, rate, the point."""
    points = [(side, rate, p[key]) for side in ("colocated", "epd") for rate, p in mix(d)[side]["points"].items()]
    return max(points, key=lambda t: (t[2]["max"] - t[2]["min"]) / t[2]["median"])


def planning_summary(d3: dict, d7: dict) -> str:
    """docs/planning.md's summary of the planner's error over both shaped runs, counted strictly."""
    both = [mix(d3), mix(d7)]
    errors = [e for s in both for e in planner.recompute(s, "")]
    ttft, tpot = widest(d3, "p50_ttft_ms")[2], widest(d7, "p99_tpot_ms")[2]
    return (
        f"{STRICT.format(runs=d3['runs'])}. Both runs' predictions were made by `eric-epd plan --rates` from the "
        f"profile each run took first and committed before the runs: {planner.ranges(errors)}; "
        f"{planner.count(errors)}. Near saturation TTFT turns on a few percent of capacity and the runs spread widely "
        f"(shaped3b's widest point {ttft['min'] / 1000:.1f}-{ttft['max'] / 1000:.1f} s), and a p99 over "
        f"{d3['prompts_per_point']} requests is itself noisy (shaped7b's widest TPOT p99 point {tpot['min']:.0f}-"
        f"{tpot['max']:.0f} ms)"
    )


def decode_context(d: dict) -> str:
    """docs/planning.md: TPOT at batch 16 on one core after short prompts and after the mix's (the profile taken
    again, which measures both)."""
    at16 = [p for p in mix(d)["profile"]["shares"][0]["engine"]["decode"] if p["batch"] == 16]
    at16.sort(key=lambda p: p["context_tokens"])
    short, long = at16[0], at16[-1]
    return (
        f"decodes 16 requests at {short['tpot_s'] * 1e3:.0f} ms a token after short prompts "
        f"({short['context_tokens']} tokens) and {long['tpot_s'] * 1e3:.0f} ms after prompts as long as the mix's "
        f"({long['context_tokens']} tokens"
    )


def quick(q: dict, c: dict) -> str:
    """The --quick EPD row: heavy and single from the first run, tiny and repeat from the _cache run."""

    def r(d: dict, series: str, rate: str, key: str) -> str:
        return x(d["ratios"][series][rate][key])

    def ttft(d: dict, names: tuple[str, ...]) -> str:
        return ", ".join(f"{s} {r(d, s, '0.5', 'p50_ttft_ms')} / {r(d, s, 'inf', 'p50_ttft_ms')}" for s in names)

    goodput = [q["ratios"][s][k]["request_goodput"] for s in ("heavy", "single") for k in ("0.5", "inf")]
    goodput += [c["ratios"][s][k]["request_goodput"] for s in ("tiny", "repeat") for k in ("0.5", "inf")]
    return (
        f"TPOT p99: heavy (4-8 images, 224-448 px, small) {r(q, 'heavy', '0.5', 'p99_tpot_ms')} at 0.5 req/s, "
        f"{r(q, 'heavy', 'inf', 'p99_tpot_ms')} all at once (first run); repeat "
        f"{r(c, 'repeat', 'inf', 'p99_tpot_ms')} all at once (`_cache` run). TTFT p50 at 0.5 req/s / all at once: "
        f"{ttft(c, ('tiny', 'repeat'))} (`_cache` run: fresh images per run, Eric's content cache on); "
        f"{ttft(q, ('heavy', 'single'))} (first run, images reused across rates). Goodput (TTFT "
        f"{q['slo_ms']['ttft'] / 1000:g} s, TPOT {q['slo_ms']['tpot']:g} ms) "
        f"{span([g for g in goodput if g is not None], x)}"
    )


def multiturn(d: dict) -> str:
    """The multi-turn row: TTFT p50 per turn of both sides, EPD's encodes and loads, prefix hits."""
    turns = d["runs"]["multiturn"]
    two = [tuple(turns[s]["turns"]["two_images_first"][f"turn{n}"] for s in ("epd", "colocated")) for n in (1, 2, 3)]
    one, one_col = (turns[s]["turns"]["one_image_first"]["turn3"] for s in ("epd", "colocated"))
    ttfts = [f"turn {n} {e['ttft_p50_ms']:.0f} / {c['ttft_p50_ms']:.0f}" for n, (e, c) in enumerate(two, 1)]
    equal = all(e["prefix_hit_tokens"] == c["prefix_hit_tokens"] for e, c in two)
    encoded, loaded = (", ".join(f"{e[k]:.0f}" for e, _ in two) for k in ("eric_encoded", "loaded_items"))
    return (
        f"two images first: {ttfts[0]} ms, {', '.join(ttfts[1:])}; per EPD turn Eric encoded {encoded} (the new "
        f"images; the resent {two[1][0]['eric_cached']:.0f} from its content cache), vLLM loaded {loaded}, "
        f"prefix-cache hits "
        f"{'equal' if equal else 'unequal'} on both sides. One image first (PD path until turn 3): turn 3 "
        f"{one['ttft_p50_ms']:.0f} / {one_col['ttft_p50_ms']:.0f} ms, Eric encoded {one['eric_encoded']:.0f} and vLLM "
        f"loaded {one['loaded_items']:.0f} (the first images again), "
        f"{'no prefix hit' if not one['prefix_hit_tokens'] else 'a prefix hit'} (colocated "
        f"{one_col['prefix_hit_tokens']:.0f} tokens)"
    )


def audio_epd(d: dict) -> str:
    """The audio EPD passage: cost ratios, settings, the ratios at each rate."""
    r = d["series"]["audio"]["ratios"]
    thr, tpot = ([x(r[k][m]) for k in ("0.4", "0.8", "inf")] for m in ("request_throughput", "p99_tpot_ms"))
    good = [x(r[k]["request_goodput"]) for k in ("0.4", "0.8")]
    return (
        f"prefill per token over the tower per audio token {f2(d['cost_ratios']['shaped_prefill_over_encoder'])} "
        f"against the released {f2(d['cost_ratios']['released_prefill_over_encoder'])}; one 3-15 s clip and "
        f"{d['output_tokens']} output tokens a request, {d['prompts_per_point']} prompts a point, medians of "
        f"{d['runs']} runs): EPD / colocated throughput {thr[0]}, {thr[1]} and {thr[2]} at 0.4, 0.8 req/s and all at "
        f"once, TPOT p99 {', '.join(tpot)}, goodput {good[0]} and {good[1]}."
    )


def audio_core(d: dict) -> str:
    """Eric's core time per clip in the audio EPD run and what it implies."""
    stages = d["series"]["audio"]["epd"]["stages_s"]["eric"]
    rate = d["series"]["audio"]["epd"]["points"]["inf"]["request_throughput"]["median"]
    core = eric_core_s(stages)
    return (
        f"Eric spends about {f2(core)} s of its core per clip (preprocess {f2(stages['preprocess'])} s, encode "
        f"{f2(stages['batch_compute'])} s; the sum of its stage means, the engine queue aside), so at EPD's "
        f"{f2(rate)} req/s its core idles {1 - rate * core:.0%} of the time while colocated vLLM has both cores for "
        f"the language model. One Eric core ({1 / core:.1f} clips/s) would feed three to four engine cores "
        f"({f2(rate)} req/s each)"
    )
