"""The planner's accuracy as the README and docs/planning.md report it, recomputed from a shaped run's JSON
(benchmarks/results/epd_vs_colocated_shaped*.json): each prediction of throughput, TTFT p50 and TPOT p99, both sides,
every rate, over the measured median of the runs, minus one. Counted strictly: a figure is a hit only within 15% of
the median; a miss inside the runs' min-max is shown beside the count and never counted as a hit.

A run's predictions (`predicted` of each side) are those `eric-epd plan --rates` wrote before the run to the committed
file the JSON names (tests/project/test_predictions_first.py checks they are the same and came first)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tests.support.readme_figures import pct_span

LIMIT = 0.15
"""A prediction is a hit within this relative error of the measured median, and only then."""
MEASURES = {
    "request_throughput": ("request_throughput",),
    "p50_ttft_ms": ("ttft_ms", "p50"),
    "p99_tpot_ms": ("tpot_ms", "p99"),
}
"""Measured key -> where the planner's Prediction holds it (as benchmarks/epd_report.py reads it)."""
NAMES = {"request_throughput": "throughput", "p50_ttft_ms": "TTFT p50", "p99_tpot_ms": "TPOT p99"}
SIDES = ("colocated", "epd")


@dataclass(frozen=True)
class Error:
    """One predicted figure against the runs: prediction / median - 1, and whether the prediction lies inside the
    runs' min-max."""

    side: str
    rate: str
    measure: str
    error: float
    inside: bool


def hit(e: Error) -> bool:
    """Strict: within 15% of the measured median. The runs' spread does not count."""
    return abs(e.error) <= LIMIT


def recompute(series: dict, suffix: str) -> list[Error]:
    """Every prediction of `predicted{suffix}` against the measured points, from those two fields alone."""
    out = []
    for side in SIDES:
        for rate, measured in series[side]["points"].items():
            predicted = series[side][f"predicted{suffix}"][rate]
            for key, path in MEASURES.items():
                value = predicted
                for part in path:
                    value = value[part]
                m = measured[key]
                out.append(Error(side, rate, key, value / m["median"] - 1.0, m["min"] <= value <= m["max"]))
    return out


def stored_disagreements(series: dict, suffix: str) -> list[tuple[str, str, str]]:
    """(side, rate, key) where the JSON's `prediction_errors{suffix}` differs from the recomputed error or spread flag,
    or lacks it."""
    stored = series[f"prediction_errors{suffix}"]
    out = []
    for e in recompute(series, suffix):
        errs = stored.get(e.side, {}).get(e.rate, {})
        if e.measure not in errs or not math.isclose(errs[e.measure], e.error, rel_tol=1e-9, abs_tol=1e-12):
            out.append((e.side, e.rate, e.measure))
        if errs.get(e.measure + "_in_spread") != e.inside:
            out.append((e.side, e.rate, e.measure + "_in_spread"))
    return out


def count(errors: Iterable[Error]) -> str:
    """'20 of 30 within 15% (5 of the 10 misses inside the runs' min-max, not counted)'."""
    errors = list(errors)
    misses = [e for e in errors if not hit(e)]
    inside = sum(e.inside for e in misses)
    beside = f"{inside} of the {len(misses)} misses inside the runs' min-max, not counted" if misses else "no misses"
    return f"{len(errors) - len(misses)} of {len(errors)} within 15% ({beside})"


def ranges(errors: Iterable[Error]) -> str:
    """'throughput +1% to +8%, TTFT p50 -12% to +53%, TPOT p99 -27% to +19%'."""
    errors = list(errors)
    return ", ".join(f"{NAMES[k]} {pct_span(e.error for e in errors if e.measure == k)}" for k in MEASURES)


def accuracy(series: dict, suffix: str) -> str:
    """One profile's ranges and strict count."""
    errors = recompute(series, suffix)
    return f"{ranges(errors)}; {count(errors)}"


def per_measure(series: dict, suffix: str) -> str:
    """The README's target cell: hits per measure, met only when every figure is a hit."""
    errors = recompute(series, suffix)
    parts = [
        f"{NAMES[k]} {sum(hit(e) for e in errors if e.measure == k)} of {sum(e.measure == k for e in errors)}"
        for k in MEASURES
    ]
    return ", ".join(parts) + (": met" if all(map(hit, errors)) else ": **not met**")
