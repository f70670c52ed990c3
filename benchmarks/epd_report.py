"""The report of benchmarks/epd_vs_colocated.py: medians and spread over runs, EPD/colocated ratios, the planner's
error against what was measured, pipeline efficiency, a printed table and the PNG."""

from __future__ import annotations

import os
import statistics

KEYS = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "completed",
)
RATIO_KEYS = ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "request_throughput", "request_goodput")
PREDICTED = {
    "request_throughput": ("request_throughput",),
    "p50_ttft_ms": ("ttft_ms", "p50"),
    "p99_tpot_ms": ("tpot_ms", "p99"),
}
"""Measured key -> where the planner's Prediction holds it."""


def summarize(runs: list[dict]) -> dict:
    """Per key: the median over runs and the spread (min, max)."""
    out: dict = {}
    for k in KEYS:
        values = [r[k] for r in runs if r.get(k) is not None]
        if values:
            out[k] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def ratios(series: dict) -> dict:
    """EPD over colocated per rate, on the medians."""
    out: dict = {}
    for rate, epd in series["epd"]["points"].items():
        col = series["colocated"]["points"].get(rate)
        if not col:
            continue
        out[rate] = {
            k: epd[k]["median"] / col[k]["median"] if epd.get(k) and col.get(k) and col[k]["median"] else None
            for k in RATIO_KEYS
        }
    return out


def _predicted(prediction: dict, path: tuple[str, ...]) -> float:
    value = prediction
    for part in path:
        value = value[part]
    return value


def prediction_errors(series: dict) -> dict:
    """Per side and rate: the planner's prediction over the measured median, minus one, for throughput, TTFT p50
    and TPOT p99 (a hit only within +-15%), and whether it falls inside the runs' spread (min to max: shown beside
    the count, never counted as a hit)."""
    out: dict = {}
    for side in ("colocated", "epd"):
        for rate, measured in series[side]["points"].items():
            predicted = series[side].get("predicted", {}).get(rate)
            if not predicted:
                continue
            errors: dict = {}
            for key, path in PREDICTED.items():
                value = _predicted(predicted, path)
                if measured.get(key) and measured[key]["median"]:
                    errors[key] = value / measured[key]["median"] - 1.0
                    errors[key + "_in_spread"] = measured[key]["min"] <= value <= measured[key]["max"]
            out.setdefault(side, {})[rate] = errors
    return out


def pipeline_efficiency(series: dict) -> float | None:
    """EPD's saturated throughput over the smaller of Eric alone's and the engine alone's capacity on their shares
    (from the profile run in the same benchmark)."""
    capacity = series.get("capacity_alone")
    sat = series["epd"]["points"].get("inf")
    if not capacity or not sat or not min(capacity.values()):
        return None
    return sat["request_throughput"]["median"] / min(capacity["eric"], capacity["engine"])


def print_table(results: dict) -> None:
    """One row per series and rate: the ratios, then the planner's errors and the pipeline efficiency."""
    cols = ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "request_throughput", "request_goodput")
    lines = [f"{'series':10} {'rate':>6} | " + " ".join(f"{c:>18}" for c in cols)]
    for name, series in results["series"].items():
        for rate, r in series["ratios"].items():
            lines.append(f"{name:10} {rate:>6} | " + " ".join(f"{r[c]:18.2f}" if r[c] else f"{'-':>18}" for c in cols))
    lines.append("EPD/colocated ratios of medians: below 1 is better for TTFT/TPOT, above 1 for throughput, goodput")
    for name, series in results["series"].items():
        if series.get("cost_check"):
            lines.append(f"{name}: cost ratios " + ", ".join(f"{k} {v:.2f}" for k, v in series["cost_check"].items()))
        eff = series.get("pipeline_efficiency")
        lines.append(f"{name}: pipeline efficiency {eff:.2f}" if eff else f"{name}: pipeline efficiency -")
        for side, by_rate in series.get("prediction_errors", {}).items():
            errors = [
                (k, v, errs.get(k + "_in_spread"))
                for errs in by_rate.values()
                for k, v in errs.items()
                if not k.endswith("_in_spread")
            ]
            misses = [bool(inside) for _, v, inside in errors if abs(v) > 0.15]
            lines.append(
                f"  planner vs measured, {side}: {len(errors) - len(misses)} of {len(errors)} within 15% ("
                f"{sum(misses)} of the {len(misses)} misses inside the runs' spread, not counted; "
                + "; ".join(
                    f"{rate}: "
                    + ", ".join(
                        f"{k.split('_')[0] if 'ms' not in k else k} {v:+.0%}"
                        for k, v in errs.items()
                        if not k.endswith("_in_spread")
                    )
                    for rate, errs in by_rate.items()
                )
                + ")"
            )
    print("\n".join(lines))


def plot(results: dict, path) -> None:
    """TTFT p50, TPOT p99 and goodput against request rate (medians, spread as error bars), both sides and the
    planner's predictions, one row of panels per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, series in results["series"].items() if series["epd"]["points"]]  # rate sweeps only
    if not names:
        return
    panels = (
        ("p50_ttft_ms", "TTFT p50 (ms)", ("ttft_ms", "p50")),
        ("p99_tpot_ms", "TPOT p99 (ms)", ("tpot_ms", "p99")),
        ("request_goodput", "goodput (req/s)", ("request_goodput",)),
    )
    fig, axes = plt.subplots(len(names), len(panels), figsize=(15, 3.6 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        series = results["series"][name]
        for col, (key, label, where) in enumerate(panels):
            ax = axes[row][col]
            for side, colour in (("colocated", "C0"), ("epd", "C1")):
                points = series[side]["points"]
                rates = list(points)
                top = max((float(x) for x in rates if x != "inf"), default=1.0)
                xs = [float(r) if r != "inf" else top * 1.5 for r in rates]
                med = [points[r][key]["median"] if key in points[r] else 0 for r in rates]
                err = [
                    [m - points[r][key]["min"] if key in points[r] else 0 for m, r in zip(med, rates)],
                    [points[r][key]["max"] - m if key in points[r] else 0 for m, r in zip(med, rates)],
                ]
                ax.errorbar(xs, med, yerr=err, fmt="o-", color=colour, label=side, capsize=3)
                predicted = series[side].get("predicted", {})
                if predicted:
                    ys = [_predicted(predicted[r], where) for r in rates]
                    ax.plot(xs, ys, "x--", color=colour, alpha=0.6, label=f"{side} (planner)")
            ax.set_xlabel("request rate (req/s; rightmost: all at once)")
            ax.set_title(f"{name}: {label}")
            ax.legend(fontsize=7)
    fig.suptitle(
        f"EPD vs colocated vLLM, {os.cpu_count()} CPU cores, medians of {results['runs']} runs "
        f"(bars: min-max), SLO TTFT {results['slo_ms']['ttft']:.0f} ms / TPOT "
        f"{results['slo_ms']['tpot']:.0f} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
