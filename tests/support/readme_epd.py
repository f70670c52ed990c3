"""The README's passages on the EPD-against-colocated runs (benchmarks/epd_vs_colocated*.py) built from their JSON,
one function per passage, for tests/project/test_readme_figures.py: the shaped runs and the planner's error, the
--quick and multi-turn runs, the audio run, and docs/planning.md's summary over both shaped runs."""

from __future__ import annotations

import re

from tests.support import readme_planner as planner
from tests.support.readme_figures import eric_core_s, f1, f2, pct_span, span, x


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
    """The stored cost check: shaped7b's from the run's own profile, shaped3b's from its profile taken again the
    morning after the run (its own is `cost_check_first`)."""
    return f2(mix(d)["cost_check"][key])


def cost_check(d: dict, which: str) -> str:
    """The rows' cost check: FLOPs, then measured against Eric and vLLM's encoder."""
    return (
        f"Cost check ({which}): prefill / tower per image token {cost(d, 'flops_prefill_over_encoder')} in "
        f"FLOPs, {cost(d, 'measured_prefill_over_eric')} measured against Eric, "
        f"{cost(d, 'measured_prefill_over_vllm_encoder')} against vLLM's encoder"
    )


RUNS_PROFILE = "the run's profile"
STRICT = (
    "counted strictly: a figure is a hit only within 15% of the median; a miss inside the {runs} runs' min-max is "
    "shown, not counted"
)
EVENING = (
    "the profile taken again on {date} evening with decode measured at the mix's context too, a profiler feature "
    "added after the misses were seen (`benchmarks/epd_repredict.py`; the measured points are the run's)"
)


def shaped3b_errors(d: dict) -> str:
    """The shaped3b row: the planner's errors with the run's own profile and the two taken again, the cost check,
    the target (strictly, the run's own profile)."""
    s, first = mix(d), mix(d)["cost_check_first"]
    return (
        f"Planner against measured medians, {STRICT.format(runs=d['runs'])}. The run's own profile, taken before the "
        f"runs, 5 simulated seeds (the only predictions made before the points were measured; copied into the JSON "
        f"from the file as commit 41d207e stored it): {planner.accuracy(s, '_first')}. Two re-fits after the runs, "
        f"not predictions, 10 simulated seeds: the profile taken again on {repredicted_on(d)} morning, its engine "
        f"capacity measured on text-only prompts after the run showed the first profile's to be wrong (decode at "
        f"short contexts only): {planner.accuracy(s, '_at_run')}; and {EVENING.format(date=repredicted_on(d))}: "
        f"{planner.accuracy(s, '')}. {cost_check(d, 'the profile taken again in the morning')} (the run's own "
        f"profile: {f2(first['measured_prefill_over_eric'])} and {f2(first['measured_prefill_over_vllm_encoder'])}) "
        f"| planner within 15% (the run's own profile): {planner.per_measure(s, '_first')}"
    )


def shaped7b_row(d: dict) -> str:
    """The shaped7b row: the ratios' ranges, the planner's errors with the run's own profile and the one taken again,
    the cost check, the target (strictly, the run's own profile)."""
    s = mix(d)
    return (
        f"throughput {span(ratios(d, 'request_throughput'), x)}, TPOT p99 {span(ratios(d, 'p99_tpot_ms'), x)}, "
        f"goodput {span(ratios(d, 'request_goodput'), x)}, TTFT p50 "
        f'{span(ratios(d, "p50_ttft_ms"), lambda v: f"{v:.1f}x")} (table in "Does EPD pay?"); pipeline efficiency '
        f"{f2(s['pipeline_efficiency'])}. Planner against measured medians, {STRICT.format(runs=d['runs'])}. The "
        f"run's own profile, taken before the runs, decode after short prompts only (the only predictions): "
        f"{planner.accuracy(s, '_at_run')}. A re-fit after the runs, not a prediction: "
        f"{EVENING.format(date=repredicted_on(d))}: {planner.accuracy(s, '')}. {cost_check(d, RUNS_PROFILE)} "
        f"| planner within 15% (the run's own profile): {planner.per_measure(s, '_at_run')}"
    )


def repredicted_on(d: dict) -> str:
    """The date epd_repredict.py took the profile again."""
    return re.search(r"\d{4}-\d\d-\d\d", mix(d)["repredicted"])[0]


def spread(d: dict, side: str, rate: str, key: str, unit: float = 1.0, fmt=lambda v: f"{v:.0f}") -> str:
    """min-max over the runs of one measured point."""
    p = mix(d)[side]["points"][rate][key]
    return f"{fmt(p['min'] / unit)}-{fmt(p['max'] / unit)}"


def planning_summary(d3: dict, d7: dict) -> str:
    """docs/planning.md's summary of the planner's error over both shaped runs: the runs' own profiles, then the
    profiles taken again after them, each counted strictly."""
    both = [mix(d3), mix(d7)]
    own = [e for s in both for e in planner.recompute(s, planner.own(s))]
    again = [e for s in both for e in planner.recompute(s, "")]

    def pooled(measure: str) -> str:
        return pct_span(e.error for e in again if e.measure == measure)

    inf = [e.error for e in again if e.rate == "inf" and e.measure == "request_throughput"]
    return (
        f"{STRICT.format(runs=3)}. From the profiles the runs took before them (the only predictions; decode measured "
        f"after short prompts only): {planner.ranges(own)}; {planner.count(own)}. From the profiles taken again after "
        f"the runs with decode measured at the mix's context too, a profiler feature added after those misses were "
        f"seen (a re-fit, not a prediction): throughput {pooled('request_throughput')} ({pct_span(inf)} all at once: "
        f"EPD's saturated rate is below the engine's alone, pipeline efficiency "
        f"{span([s['pipeline_efficiency'] for s in both])}); TTFT p50 {pooled('p50_ttft_ms')}, the large errors near "
        f"saturation where TTFT turns on a few percent of capacity and the 3 runs spread widely (one point "
        f"{spread(d3, 'colocated', '1.075', 'p50_ttft_ms', 1000, f1)} s); TPOT p99 {pooled('p99_tpot_ms')}; "
        f"{planner.count(again)}. A p99 over 48 requests is itself noisy there (one point's three runs spread "
        f"{spread(d3, 'epd', '0.688', 'p99_tpot_ms')} ms, another {spread(d7, 'colocated', '0.41', 'p99_tpot_ms')} ms)"
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
