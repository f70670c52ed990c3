"""The machinery of tests/project/test_readme_figures.py: a Figure (a document, the benchmark JSON behind it and the
exact text it must state), the formats the README writes numbers in, and the figures derived from a JSON's fields
(ranges, a soak's RSS windows and error counts, a profile's prefill step)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from eric_epd.planning.profiles import Profile
from eric_epd.planning.simulate import EngineModel, tokens_per_item

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SOAK_WARMUP_S = 60.0
"""benchmarks/soak.py's --warmup default: RSS counts from this many seconds after a (re)start."""


@dataclass(frozen=True)
class Figure:
    """`text(data)` must appear verbatim (whitespace collapsed) in `doc`; data is the JSON of `source` under
    benchmarks/results/, or a tuple of them when `source` is a tuple."""

    source: str | tuple[str, ...]
    text: Callable[[Any], str]
    doc: str = "README.md"


@cache
def result(name: str) -> dict:
    """A benchmark's JSON under benchmarks/results/ (read once)."""
    return json.loads((RESULTS / name).read_text())


def document(name: str) -> str:
    """A document of the repository, whitespace collapsed (the README wraps its prose anywhere)."""
    return squash((ROOT / name).read_text())


def squash(text: str) -> str:
    """Every run of whitespace as one space."""
    return re.sub(r"\s+", " ", text).strip()


def stated(figure: Figure, load: Callable[[str], dict] = result) -> str:
    """The text the figure's JSON says its document must hold."""
    data = tuple(map(load, figure.source)) if isinstance(figure.source, tuple) else load(figure.source)
    return squash(figure.text(data))


def missing(figures: Iterable[Figure], load: Callable[[str], dict] = result, docs: dict[str, str] | None = None):
    """The stated texts their documents lack, as (doc, text); `docs` overrides a document's text (by name)."""
    docs = dict(docs or {})
    out = []
    for figure in figures:
        text = stated(figure, load)
        if figure.doc not in docs:
            docs[figure.doc] = document(figure.doc)
        if text not in docs[figure.doc]:
            out.append((figure.doc, text))
    return out


# formats, as the README writes them


def x(v: float) -> str:
    """A ratio: 0.98x."""
    return f"{v:.2f}x"


def f1(v: float) -> str:
    """One decimal."""
    return f"{v:.1f}"


def f2(v: float) -> str:
    """Two decimals."""
    return f"{v:.2f}"


def pct(v: float) -> str:
    """A signed percentage: +8%, -27%."""
    return f"{v:+.0%}"


def span(values: Iterable[float], fmt: Callable[[float], str] = f2) -> str:
    """min-max of the values in one format (the format's suffix once, at the end): 0.73-0.99x."""
    low, high = fmt(min(values)), fmt(max(values))
    suffix = re.sub(r"^[-+]?[\d.]+", "", low)
    return f"{low.removesuffix(suffix)}-{high}" if suffix else f"{low}-{high}"


def pct_span(values: Iterable[float]) -> str:
    """A range of signed percentages: -12% to +53%."""
    values = list(values)
    return f"{pct(min(values))} to {pct(max(values))}"


def rate(key: str) -> str:
    """A rate key of epd_vs_colocated's JSON as the README's table heads it: 0.688 -> 0.69, inf -> all at once."""
    if key == "inf":
        return "all at once"
    return str(Decimal(key).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def verdict(ok: bool) -> str:
    """A target's outcome in bold."""
    return "**met**" if ok else "**not met**"


def met(ok: bool) -> str:
    """A target's outcome where the README writes 'met' plainly."""
    return "met" if ok else "**not met**"


# derived figures


def ratio_row(series: dict, label: str, key: str, target: Callable[[list[float]], str] | None = None) -> str:
    """A row of the "Does EPD pay?" tables: EPD / colocated of `key` at every rate ('- (both 0)' where both sides
    measured 0), then the target's cell if given."""
    cells = []
    for rate_key, ratios in series["ratios"].items():
        value = ratios[key]
        if value is None:
            sides = (series[s]["points"][rate_key][key]["median"] for s in ("epd", "colocated"))
            cells.append("- (both 0)" if not any(sides) else "?")
        else:
            cells.append(x(value))
    row = f"| {label} | " + " | ".join(cells) + " |"
    values = [v[key] for v in series["ratios"].values() if v[key] is not None]
    return row + (f" {target(values)} |" if target else "")


def rate_head(series: dict) -> str:
    """The head row of a "Does EPD pay?" table."""
    return "| rate (req/s) | " + " | ".join(rate(k) for k in series["ratios"]) + " |"


def profile(data: dict) -> Profile:
    """A stored profile, typed."""
    return msgspec.json.decode(json.dumps(data), type=Profile)


def prefill_step(data: dict) -> tuple[int, float]:
    """(prompt tokens of the mix, seconds) of one engine step holding a whole prompt's prefill on the profile's
    first share: the profile's fitted seconds per prefill token times the mix's prompt length."""
    prof = profile(data)
    tokens = round(prof.traffic.images_per_request * tokens_per_item(prof)) + prof.traffic.prompt_tokens
    return tokens, EngineModel.from_side(prof.shares[0].engine, False, 2048, 16).slope_s * tokens


def eric_core_s(stages: dict[str, float]) -> float:
    """Seconds of Eric's own core per request from its stage means: every stage but waiting in the engine queue."""
    return sum(v for k, v in stages.items() if k != "engine_queue")


def last_instance(samples: list[list[float]]) -> list[list[float]]:
    """The samples (t, age, rss) of a process's last instance: the soak restarts some processes."""
    instance: list[list[float]] = []
    for sample in samples:
        if instance and sample[1] < instance[-1][1]:
            instance = []
        instance.append(sample)
    return instance


def warm_samples(samples: list[list[float]]) -> list[list[float]]:
    """The last instance's samples after warm-up: what soak.json's rss_growth compares, first to last."""
    return [s for s in last_instance(samples) if s[1] >= SOAK_WARMUP_S and s[2] > 0]


def rss_window_min(samples: list[list[float]]) -> int:
    """Minutes the last instance's RSS growth spans."""
    warm = warm_samples(samples)
    return round((warm[-1][1] - warm[0][1]) / 60) if len(warm) >= 2 else 0


def errors_during(soak: dict, word: str) -> int:
    """Clean errors that ended inside a fault whose description names `word`."""
    windows = [(start, end) for start, end, what in soak["faults"] if word in what]
    return sum(1 for t, kind in soak["timeline"] if kind == "clean_error" and any(a <= t <= b for a, b in windows))


def fault_gap_s(soak: dict) -> int:
    """Seconds from the start (and from each fault's end) to the next fault, when they all agree to the second."""
    starts = [f[0] for f in soak["faults"]]
    gaps = {round(b - a) for a, b in zip([0.0] + [f[1] for f in soak["faults"]], starts)}
    return gaps.pop() if len(gaps) == 1 else -1
