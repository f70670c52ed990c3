"""The README's rows on the encoder, soak, cache-routing and GPU-projection benchmarks built from their JSON, one
function per passage, for tests/project/test_readme_figures.py: each returns exactly what the README must say."""

from __future__ import annotations

from tests.support.readme_figures import (
    SOAK_WARMUP_S,
    errors_during,
    f2,
    fault_gap_s,
    met,
    pct_span,
    rss_window_min,
    span,
    verdict,
    x,
)

GEMM, FLASH = ("aten::addmm", "aten::mm"), ("aten::_scaled_dot_product_flash_attention_for_cpu",)
SIZES = ("small", "mixed", "large")


def encoder_throughput(d: dict) -> str:
    """The float32 row: ratios and which targets (1.5x / 1.5x / >= 0.95x) are not met."""
    r = {w: d["runs"]["float32"][w]["ratio"] for w in SIZES}
    missed = [w for w, target in zip(SIZES, (1.5, 1.5, 0.95)) if r[w] < target]
    ratios = ", ".join(f"{w} {x(v)}" for w, v in r.items())
    return f"{ratios} | 1.5x / 1.5x / >=0.95x: **not met** for " + ", ".join(missed)


def by_size(d: dict, dtype: str, key: str, fmt=f2) -> str:
    """encoder_throughput's Eric figure for small / mixed / large."""
    return " / ".join(fmt(d["runs"][dtype][w]["eric"][key]) for w in SIZES)


def qwen3_vl(d: dict) -> str:
    """The Qwen3-VL row: ratios and fractions of the GEMM ceiling."""
    ratios = ", ".join(f"{w} {x(d['runs']['float32'][w]['ratio'])}" for w in SIZES)
    return f"{ratios}; GEMM ceiling {by_size(d, 'float32', 'fraction_of_gemm_ceiling')}"


def encoder_bf16(d: dict) -> str:
    """The bfloat16 row: ratios, fractions of the GEMM ceiling, the two matmul rates, the target."""
    ratios = " / ".join(x(d["runs"]["bfloat16"][w]["ratio"]) for w in SIZES)
    ok = all(d["runs"]["bfloat16"][w]["eric"]["fraction_of_gemm_ceiling"] >= 0.75 for w in ("mixed", "large"))
    bf16, f32 = (d["matmul_flops"][k] / 1e9 for k in ("bfloat16", "float32"))
    return (
        f"{ratios}; GEMM ceiling {by_size(d, 'bfloat16', 'fraction_of_gemm_ceiling')} (this CPU has AVX2 only: bf16 "
        f"GEMMs run at {bf16:.1f} GFLOP/s against {f32:.0f} in float32) | >= 75% of the GEMM ceiling on mixed and "
        f"large: {met(ok)}"
    )


def why_float32(d: dict) -> str:
    """The paragraph under the table: float32's ratios and how close Eric runs to the matmul rate."""
    runs = d["runs"]["float32"].values()
    return (
        f"Why float32 stops at {span([r['ratio'] for r in runs], x)} on this CPU: the tower is matmul-bound, and "
        f"Eric's tower runs its matmuls at {span([r['eric']['fraction_of_matmul_peak'] for r in runs])} of this core's "
        f"float32 matmul rate ({d['matmul_flops']['float32'] / 1e9:.0f} GFLOP/s"
    )


def compile_row(d: dict) -> str:
    """encoder_compile's gains, compile times and compiled-vs-eager errors."""

    def cases(family=None, dtype=None, images=(1, 4, 8), sides=(224, 448)) -> list[dict]:
        return [
            c
            for fam, by_dtype in d["families"].items()
            for dt, run in by_dtype.items()
            for c in run["cases"]
            if family in (None, fam) and dtype in (None, dt) and c["images"] in images and c["side"] in sides
        ]

    def gains(**kw) -> str:  # +17-19%
        g = [c["gain"] for c in cases(**kw)]
        return f"{min(g):+.0%}"[:-1] + f"-{max(g):.0%}"

    def rel(dtype: str, exponent: int) -> str:  # 5-9e-6
        v = [c["rel_err"] / 10**exponent for c in cases(dtype=dtype)]
        return f"{min(v):.0f}-{max(v):.0f}e{exponent}"

    compile_s = [run["compile_s"] for by_dtype in d["families"].values() for run in by_dtype.values()]
    return (
        f"{pct_span([c['gain'] for c in cases()])} images/s (Qwen2.5-VL float32 4-8 x 448 px: "
        f"{gains(family='qwen2_5_vl', dtype='float32', images=(4, 8), sides=(448,))}; Qwen2-VL float32: "
        f"{gains(family='qwen2_vl', dtype='float32')}), {min(compile_s):.0f}-{max(compile_s):.0f} s of compiling at "
        f"start; compiled vs eager {rel('float32', -6)} (float32), {rel('bfloat16', -2)} (bfloat16) of the largest "
        "value."
    )


def two(d: dict, server: str, key: str = "median", fmt=f2) -> str:
    """eric_vs_vllm_encoder's figure of one server at concurrency 1 / 8."""
    return " / ".join(fmt(d["servers"][server][c][key]) for c in ("1", "8"))


def vs_vllm(d: dict) -> str:
    """Eric against vLLM's own encoder in float32: images/s of each server and Eric's ratios."""
    vllm = d["servers"]["vllm"]
    return (
        f"images/s (medians): vLLM {f2(vllm['1']['median'])} at concurrency 1, {f2(vllm['8']['median'])} at 8; Eric "
        f"eager {two(d, 'eric_eager')} ({two(d, 'eric_eager', 'vs_vllm', x)}); Eric compiled "
        f"{two(d, 'eric_compiled')} ({two(d, 'eric_compiled', 'vs_vllm', x)})."
    )


def vs_vllm_bf16(d: dict) -> str:
    """The same in bfloat16."""
    return (
        f"vLLM {two(d, 'vllm')}, Eric eager {two(d, 'eric_eager')} ({two(d, 'eric_eager', 'vs_vllm', x)}), compiled "
        f"{two(d, 'eric_compiled')} ({two(d, 'eric_compiled', 'vs_vllm', x)})"
    )


def vs_vllm_target(d: dict) -> str:
    """The target's outcome: Eric compiled against vLLM's own encoder."""
    compiled = [d["servers"]["eric_compiled"][c]["vs_vllm"] for c in ("1", "8")]
    return f"Eric >= 1.3x vLLM's own path per core: {verdict(min(compiled) >= 1.3)} ({span(compiled, x)})"


def enc(d: dict, encoder: str) -> dict:
    """encoder_throughput_{gemma3,internvl}'s figures of one encoder."""
    return d["runs"]["float32"]["encoders"][encoder]


def tower(d: dict, between: str = "; both at ") -> str:
    """Gemma 3's and InternVL's rows: images/s of each encoder, the tower against the generic path, their
    fractions of the GEMM + attention floor and the 1.2x target ('between' goes before the fractions)."""
    ratio = d["runs"]["float32"]["ratio_vs_generic"]["tower"]
    encoders = ("tower", "generic", "transformers")
    ips, floor = ({e: f2(enc(d, e)[k]) for e in encoders} for k in ("images_per_s", "fraction_of_floor"))
    return (
        f"tower {ips['tower']} img/s, generic {ips['generic']}, transformers {ips['transformers']}: tower {x(ratio)} "
        f"the generic path{between}{floor['tower']} / {floor['generic']} of the GEMM + attention floor | 1.2x the "
        f"generic path: {verdict(ratio >= 1.2)}"
    )


def gemma3_glue(d: dict) -> str:
    """What is left of a batch beyond the floor, at most."""
    return f"at most {1 - max(enc(d, e)['fraction_of_floor'] for e in ('tower', 'generic')):.0%} of a batch is glue"


def internvl(d: dict) -> str:
    """InternVL's row, with the spread of single batches."""
    batches = span(enc(d, "tower")["batch_s"] + enc(d, "generic")["batch_s"])
    return tower(d, f" (single batches vary {batches} s on this shared CPU); ")


def internvl_target(d: dict) -> str:
    """InternVL's target cell: the profiles' shares and the batch time 1.2x would need against the floor."""
    run = d["runs"]["float32"]

    def share(encoder: str, ops: tuple[str, ...]) -> str:
        return f"{sum(r['share'] for r in run['profile'][encoder] if r['op'] in ops):.0%}"

    return (
        f"(GEMMs {share('tower', GEMM)} and {share('generic', GEMM)}, flash attention {share('tower', FLASH)} and "
        f"{share('generic', FLASH)} of the tower's and the generic path's profiles); 1.2x needs a batch in "
        f"{enc(d, 'generic')['median_batch_s'] / 1.2:.2f} s, under the floor of the GEMMs and attention alone "
        f"({run['floor_s']:.2f} s)"
    )


def transfer(d: dict) -> str:
    """The transfer row at 64 MiB."""
    gbps = {k: v["64"] for k, v in d["gbps"].items()}
    return (
        f"{f2(d['shm_fraction_of_memcpy_at_64MiB'])} of memcpy ({gbps['shm']:.1f} GB/s); NIXL {gbps['nixl']:.1f}, "
        f"Mooncake(TCP) {gbps['mooncake']:.1f}, HTTP {f2(gbps['http'])} GB/s | >= 0.5: "
        f"{met(d['shm_fraction_of_memcpy_at_64MiB'] >= 0.5)}"
    )


def eric_overhead(d: dict) -> str:
    """Eric's fixed overhead and images/s at concurrency 8 (median and range of the rounds); then the earlier runs'
    figures, labelled."""
    rounds = d["eric"]["c8_images_per_s"]
    return (
        f"| {f2(d['overhead_p50_ms'])} ms; {d['c8_images_per_s']:.0f} img/s (median of {len(rounds)} rounds: "
        f"{min(rounds):.0f}-{max(rounds):.0f}); earlier runs (no JSON)"
    )


def eric_overhead_run(d: dict) -> str:
    """One run's overhead with each client and its images/s at concurrency 8 (for the row's paired runs)."""
    return (
        f"{f2(d['overhead_p50_ms'])} ms with an aiohttp client, {f2(d['overhead_p50_ms_httpx_client'])} ms with "
        f"httpx, {d['c8_images_per_s']:.0f} img/s"
    )


def eric_overhead_target(d: dict) -> str:
    """The overhead row's targets."""
    t = d["targets"]
    return (
        f"| <= {t['overhead_p50_ms']:g} ms: {met(d['overhead_p50_ms'] <= t['overhead_p50_ms'])} in the recorded run, "
        f"not in every earlier one; >= {t['c8_images_per_s']:g} img/s: "
        f"{met(d['c8_images_per_s'] >= t['c8_images_per_s'])} |"
    )


def gateway_overhead(d: dict) -> str:
    """The gateway's added latency, its req/s against direct, then the earlier runs' figures, labelled."""
    return f"| {f2(d['overhead_ms']['p50'])} ms; req/s {x(d['rps_ratio'])} direct; earlier runs (no JSON)"


def gateway_target(d: dict) -> str:
    """The gateway row's target."""
    p50, target = d["overhead_ms"]["p50"], d["target_p50_overhead_ms"]
    return f"| <= {target:g} ms: {met(p50 <= target)} in the recorded run"


def gateway_epd(d: dict) -> str:
    """The gateway's added latency on the EPD path (difference of p50s, median of paired differences, p99) and its
    req/s against the client making the same calls."""
    o = d["overhead_ms"]
    return (
        f"| {f2(o['p50'])} ms p50 (median of paired differences {f2(d['paired_median_overhead_ms'])} ms), p99 "
        f"{f2(o['p99'])} ms, over {f2(d['latency_ms']['direct']['50'])} ms direct; req/s {x(d['rps_ratio'])} direct "
        f"at concurrency {d['concurrency']}"
    )


def gateway_epd_httpx(d: dict) -> str:
    """The same benchmark on the code before the gateway's encode calls moved from httpx to aiohttp (its JSON)."""
    return (
        f"{f2(d['overhead_ms']['p50'])} ms p50 (median of paired differences {f2(d['paired_median_overhead_ms'])} "
        f"ms), req/s {x(d['rps_ratio'])} direct"
    )


def gateway_epd_target(d: dict) -> str:
    """The EPD-path row's target, and where the gateway's time goes (its own sums against the direct calls)."""
    g, direct = d["gateway_ms_per_request"], d["direct_calls_ms_per_request"]
    return (
        f"{gateway_target(d)}. Where it goes (the gateway's own sums per "
        f"request): body read {f2(g['stage:body_read'])} ms, checks {f2(g['stage:validate'])} ms, the encode call "
        f"{g['stage:encode'] - direct['encoder']:+.2f} ms against the direct one, the rewrite "
        f"{f2(g['stage:rewrite'])} ms"
    )


def soak_setup(d: dict) -> str:
    """The soak's load and fault spacing."""
    return (
        f"open-loop chats at {d['rate_rps'] / d['capacity_rps']:.0%} of measured capacity for {d['minutes']:g} "
        f"minutes; one fault at a time, {fault_gap_s(d)} s after the last one ended"
    )


def soak(d: dict) -> str:
    """The soak row's outcome: counts, where the errors fell, each process's RSS growth and its window."""
    c, g = d["counts"], d["rss_growth"]
    w = {k: rss_window_min(v) for k, v in d["rss"].items()}
    prefill, gateway = errors_during(d, "prefill"), errors_during(d, "gateway")
    others = c["clean_error"] - prefill - gateway

    def rss(k: str, over: str = "") -> str:
        return f"{g[k]:+.1%} ({over}{w[k]} min" if g[k] is not None else "n/a ("

    return (
        f"capacity {f2(d['capacity_rps'])} req/s, soaked at {f2(d['rate_rps'])}; {c['accepted']} accepted, "
        f"{c['correct']} correct, {c['clean_error']} clean errors ({prefill} while the only prefill restarted, "
        f"{gateway} refused connections while the gateway did: {others or 'none'} during the Eric, store, long-batch "
        f"or drain faults), {c.get('wrong', 0)} wrong, {c.get('lost', 0)} lost; RSS growth of each process's last "
        f"instance after its {SOAK_WARMUP_S:g} s warm-up (the soak restarts most of them, so the windows differ): "
        f"Eric B {rss('eric_b', 'over ')}), prefill {rss('prefill')}), decode {rss('decode')}), gateway "
        f"{rss('gateway')}), store master {rss('store')}; it was stopped, then caught up), Eric A "
        f"{rss('eric_a')}restarted in the last minute); pools at {sum(d['pool_used_bytes_at_end'].values())} bytes "
        f"at the end; busy Erics ejected: {len(d['busy_ejected']) or 'none'}."
    )


def soak_target(d: dict) -> str:
    """The soak row's target: nothing lost or wrong, RSS under 5% but the store master's, no busy Eric ejected."""
    c, growth = d["counts"], [v for k, v in d["rss_growth"].items() if k != "store" and v is not None]
    ok = not c.get("lost") and not c.get("wrong") and max(growth) < 0.05 and not d["busy_ejected"]
    return (
        f"| lost {c.get('lost', 0)}, wrong {c.get('wrong', 0)}, RSS < 5% (store master aside), no busy Eric ejected: "
        f"{met(ok)} |"
    )


def cache_target(small: dict, tiny: dict) -> str:
    """The cache-routing row's target: compute <= 0.3x and TTFT p50 <= 0.5x, on small and on tiny."""

    def ok(d: dict, key: str, bound: float) -> bool:
        rows = d["rows"]
        return all(rows[r][key] / rows["no cache"][key] <= bound for r in ("per-Eric cache", "global cache + routing"))

    compute, ttft = (ok(tiny, "encoder_s_per_request", 0.3), ok(tiny, "ttft_p50_s", 0.5))
    small_ok = ok(small, "encoder_s_per_request", 0.3) and ok(small, "ttft_p50_s", 0.5)
    return (
        f"| compute <= 0.3x and TTFT p50 <= 0.5x: {met(small_ok)} on small ({small['requests']} chats); on tiny "
        f"compute {'met' if compute else 'not'}, TTFT {'met' if ttft else 'not'}"
    )


def cache_ratio(d: dict, key: str, per: str = "", glob: str = "") -> str:
    """cache_routing's per-Eric and global cache over no cache on one measure: '0.19x / 0.20x'."""
    rows = d["rows"]
    per_eric, shared = (rows[r][key] / rows["no cache"][key] for r in ("per-Eric cache", "global cache + routing"))
    return f"{x(per_eric)}{per} / {x(shared)}{glob}"


def cache_seconds(d: dict, key: str) -> str:
    """cache_routing's TTFT without a cache, then with each: '1.63 s to 0.23 / 0.25 s'."""
    rows = d["rows"]
    caches = (rows["per-Eric cache"][key], rows["global cache + routing"][key])
    return f"{rows['no cache'][key]:.2f} s to " + " / ".join(f"{v:.2f}" for v in caches) + " s"


def cache_small(d: dict) -> str:
    """The cache-routing row's small-model figures."""
    return (
        f"small model, {d['side']} px, {d['images']} images, {d['requests']} chats: encodes per chat "
        f"{cache_ratio(d, 'encoded_per_request', ' (per-Eric)', ' (global)')}, encoder seconds "
        f"{cache_ratio(d, 'encoder_s_per_request')}, TTFT p50 {cache_ratio(d, 'ttft_p50_s')} "
        f"({cache_seconds(d, 'ttft_p50_s')}), TTFT p99 {cache_seconds(d, 'ttft_p99_s')}"
    )


def cache_tiny(d: dict) -> str:
    """The cache-routing row's tiny-model figures."""
    return (
        f"{d['images']} images, {d['requests']} chats: encodes {cache_ratio(d, 'encoded_per_request')}, encoder "
        f"seconds {cache_ratio(d, 'encoder_s_per_request')}, TTFT p50 {cache_ratio(d, 'ttft_p50_s')}"
    )


def gpu_head(d: dict) -> str:
    """The head row of the projection's table."""
    rates = [f"{float(r):g}" for r in next(iter(d["models"].values()))]
    return f"| model | {rates[0]} req/s | " + " | ".join(rates[1:]) + " |"


def gpu_row(d: dict, model: str, label: str) -> str:
    """A row of the projection's table: the split and EPD / colocated at each rate."""
    cells = []
    for i, p in enumerate(d["models"][model].values()):
        lay, r = p["epd"]["layout"], p["ratios"]
        long = i == 0 and "3B" in model
        split = f"{lay['erics']} Erics + {lay['engines']} engines" if long else f"{lay['erics']}+{lay['engines']}"
        cells.append(f"{split}; {x(r['throughput'])} / {x(r['tpot_p99'])} / {x(r['goodput'])}")
    return f"| {label} | " + " | ".join(cells) + " |"
