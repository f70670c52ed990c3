"""`eric-epd plan`: from a profile, a traffic mix and an SLO, the split of the devices between Erics and engines that
serves the mix best, with predicted TTFT and TPOT percentiles, throughput and goodput for EPD and for colocated
serving on the same devices (simulate.py's model, averaged over seeds)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import msgspec

from eric_epd.planning.profiles import Profile, Slo, Traffic
from eric_epd.planning.simulate import (
    EngineModel,
    EricModel,
    Outcome,
    make_requests,
    outcome,
    run_engine,
    run_erics,
    tokens_per_item,
)


@dataclass(frozen=True)
class PlanConfig:
    """What to plan for: the devices in all, the mix, the SLO, the engines' scheduler limits."""

    devices: int
    traffic: Traffic
    slo: Slo
    requests: int = 200
    seeds: int = 5
    max_batched_tokens: int = 2048
    max_seqs: int = 16
    batched_token_choices: tuple[int, ...] = ()
    """Engine token budgets per step to try as well (vLLM's --max-num-batched-tokens): smaller chunks make decode
    wait less behind a prefill, at some throughput."""


class Layout(msgspec.Struct, frozen=True):
    """Erics and engines, each on a share of `eric_devices` / `engine_devices` devices (no Erics: colocated), and
    the engines' token budget per step (0: the plan's max_batched_tokens)."""

    erics: int
    eric_devices: int
    engines: int
    engine_devices: int
    max_batched_tokens: int = 0


class Prediction(msgspec.Struct, frozen=True):
    """A layout and what it is predicted to serve."""

    layout: Layout
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    request_throughput: float
    output_throughput: float
    request_goodput: float


class Plan(msgspec.Struct, frozen=True):
    """The best EPD layout, colocated serving on the same devices, every EPD layout tried, and the ratios."""

    traffic: Traffic
    slo: Slo
    devices: int
    epd: Prediction
    colocated: Prediction
    candidates: list[Prediction]
    ratios: dict[str, float] = msgspec.field(default_factory=dict)


def predict(profile: Profile, layout: Layout, config: PlanConfig) -> Prediction:
    """Simulate `layout` under config.traffic, over config.seeds seeds; medians of each figure."""
    per_item = tokens_per_item(profile)
    engine_side = profile.share(layout.engine_devices).engine
    budget = layout.max_batched_tokens or config.max_batched_tokens
    engine = EngineModel.from_side(engine_side, layout.erics == 0, budget, config.max_seqs)
    erics = (
        [EricModel.from_points(profile.share(layout.eric_devices).eric, per_item, profile.traffic.images_per_request)]
        * layout.erics
        if layout.erics
        else []
    )
    runs: list[Outcome] = []
    for seed in range(config.seeds):
        requests = make_requests(config.traffic, profile.image_tokens_for(config.traffic), config.requests, seed)
        if erics:
            run_erics(requests, erics)
        else:  # colocated: the engine's processor prepares the raw images before the request is scheduled
            for r in requests:
                r.ready = r.arrival + engine_side.own_preprocess_s_per_image_token * r.image_tokens
        for e in range(layout.engines):  # round robin over the engines
            run_engine(requests[e :: layout.engines], engine)
        runs.append(outcome(requests, config.slo.ttft_ms, config.slo.tpot_ms))
    return Prediction(
        layout,
        {k: statistics.median(r.ttft_ms[k] for r in runs) for k in runs[0].ttft_ms},
        {k: statistics.median(r.tpot_ms[k] for r in runs) for k in runs[0].tpot_ms},
        statistics.median(r.request_throughput for r in runs),
        statistics.median(r.output_throughput for r in runs),
        statistics.median(r.request_goodput for r in runs),
    )


def epd_layouts(profile: Profile, devices: int) -> list[Layout]:
    """Every way to fill `devices` with Erics and engines on the profiled share sizes (at least one of each)."""
    sizes = sorted({len(s.devices) for s in profile.shares})
    out = []
    for e_size in sizes:
        for g_size in sizes:
            for engines in range(1, devices // g_size + 1):
                erics = (devices - engines * g_size) // e_size
                if erics >= 1:
                    out.append(Layout(erics, e_size, engines, g_size))
    if not out:
        raise ValueError(f"{devices} devices fit no Eric and engine of the profiled share sizes {sizes}")
    return out


def colocated_layout(profile: Profile, devices: int) -> Layout:
    """Engines on the largest profiled share that divides the devices, as many as fit."""
    sizes = sorted((len(s.devices) for s in profile.shares), reverse=True)
    size = next((s for s in sizes if s <= devices and devices % s == 0), None)
    if size is None:
        raise ValueError(f"no profiled share size divides {devices} devices (profiled: {sizes})")
    return Layout(0, 0, devices // size, size)


def eric_share_for_host(profile: Profile, cpus: int, traffic: Traffic, slo: Slo) -> int:
    """How many of a host's `cpus` one Eric should get beside one engine on the rest (`eric-epd up`'s layout): the
    best such layout the profile covers, by predicted goodput then throughput."""
    config = PlanConfig(cpus, traffic, slo, requests=100, seeds=3)
    sizes = {len(s.devices) for s in profile.shares}
    layouts = [Layout(1, e, 1, cpus - e) for e in range(1, cpus) if e in sizes and cpus - e in sizes]
    if not layouts:
        raise ValueError(
            f"the profile covers no split of {cpus} CPUs into one Eric and one engine (profiled share "
            f"sizes: {sorted(sizes)}); profile shares of sizes e and {cpus} - e"
        )
    return max((predict(profile, lay, config) for lay in layouts), key=_goodness).layout.eric_devices


def _goodness(p: Prediction) -> tuple[float, float]:
    return p.request_goodput, p.request_throughput


def plan(profile: Profile, config: PlanConfig) -> Plan:
    """The best EPD layout by goodput (then throughput), the best colocated one, and EPD over colocated; each tried
    at every token budget of the config."""
    budgets = sorted({config.max_batched_tokens, *config.batched_token_choices}, reverse=True)
    candidates = [
        predict(profile, msgspec.structs.replace(layout, max_batched_tokens=b), config)
        for layout in epd_layouts(profile, config.devices)
        for b in budgets
    ]
    best = max(candidates, key=_goodness)
    colocated = colocated_layout(profile, config.devices)
    col = max(
        (predict(profile, msgspec.structs.replace(colocated, max_batched_tokens=b), config) for b in budgets),
        key=_goodness,
    )
    ratios = {
        "throughput": best.request_throughput / col.request_throughput,
        "ttft_p50": best.ttft_ms["p50"] / col.ttft_ms["p50"],
        "tpot_p99": best.tpot_ms["p99"] / col.tpot_ms["p99"],
        "goodput": best.request_goodput / col.request_goodput if col.request_goodput else float("inf"),
    }
    return Plan(config.traffic, config.slo, config.devices, best, col, candidates, ratios)


def render_plan(p: Plan) -> str:
    """The plan as a table: the best EPD layout and colocated serving, then EPD over colocated."""
    t = p.traffic
    lines = [
        f"traffic: {t.images_per_request} images of {'/'.join(map(str, t.sides))} px, prompt "
        f"{t.prompt_tokens}, output {t.output_tokens} tokens, rate {t.rate or 'all at once'} req/s; "
        f"SLO TTFT {p.slo.ttft_ms:.0f} ms, TPOT {p.slo.tpot_ms:.0f} ms; {p.devices} devices",
        f"{'layout':52} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'req/s':>7} {'goodput':>8}",
    ]
    for name, pred in (("EPD (best)", p.epd), ("colocated", p.colocated)):
        lay = pred.layout
        where = (
            f"{lay.erics} Eric x{lay.eric_devices} + {lay.engines} engine x{lay.engine_devices}"
            if lay.erics
            else f"{lay.engines} engine x{lay.engine_devices}"
        )
        where += f", {lay.max_batched_tokens} tok/step"
        lines.append(
            f"{name + ': ' + where:52} {pred.ttft_ms['p50']:9.0f} {pred.ttft_ms['p99']:9.0f} "
            f"{pred.tpot_ms['p50']:9.1f} {pred.tpot_ms['p99']:9.1f} {pred.request_throughput:7.3f} "
            f"{pred.request_goodput:8.3f}"
        )
    lines.append("EPD / colocated: " + ", ".join(f"{k} {v:.2f}x" for k, v in p.ratios.items()))
    return "\n".join(lines)


def render_host_split(profile: Profile) -> str:
    """Per profiled share, what an Eric item cost on the host (its router's stages) and in the vision tower, at the
    share's busiest measured point (Share.host_and_tower)."""
    lines = ["Eric per item, host (router stages: fetch, decode, preprocess, hash...) vs vision tower (forward):"]
    for share in sorted(profile.shares, key=lambda s: len(s.devices)):
        where = f"  share of {len(share.devices)} {profile.device} device(s)"
        point = share.host_and_tower()
        if point is None:
            lines.append(f"{where}: host and tower cost not measured in this profile")
            continue
        ratio = f"{point.host_s_per_item / point.tower_s_per_item:.2f}" if point.tower_s_per_item > 0 else "-"
        lines.append(
            f"{where}: host {point.host_s_per_item * 1e3:.1f} ms, tower {point.tower_s_per_item * 1e3:.1f} ms "
            f"(host / tower {ratio}) at concurrency {point.concurrency}"
        )
    return "\n".join(lines)
