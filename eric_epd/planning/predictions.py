"""`eric-epd plan --rates`: the plan's EPD layout and colocated serving predicted at each arrival rate, written to a
file before anything is measured (a benchmark then measures the same rates and compares)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from pathlib import Path

import msgspec

from eric_epd.planning.planner import Layout, Plan, PlanConfig, Prediction, predict
from eric_epd.planning.profiles import Profile, Slo, Traffic


class RatePredictions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the planner predicts before a measurement: when, from which profile (its sha256), for which mix, SLO,
    requests per point and seeds, each side's layout and its prediction at every rate ("inf": all at once)."""

    made_at: str
    profile_sha256: str
    traffic: Traffic
    slo: Slo
    requests: int
    seeds: int
    layouts: dict[str, Layout]
    points: dict[str, dict[str, Prediction]]
    """side ("epd", "colocated") -> rate -> prediction."""


def rate_key(rate: float) -> str:
    """A rate as the points are keyed: "inf" for all at once, else the number as Python prints it."""
    return "inf" if rate in (0.0, float("inf")) else str(rate)


def predict_rates(
    profile: Profile, profile_bytes: bytes, plan: Plan, config: PlanConfig, rates: tuple[float, ...]
) -> RatePredictions:
    """The plan's best EPD layout and its colocated layout, each simulated at every rate (inf or 0: all at once)."""
    layouts = {"epd": plan.epd.layout, "colocated": plan.colocated.layout}
    points: dict[str, dict[str, Prediction]] = {}
    for side, layout in layouts.items():
        for rate in rates:
            traffic = msgspec.structs.replace(config.traffic, rate=0.0 if rate == float("inf") else rate)
            at_rate = dataclasses.replace(config, traffic=traffic)
            points.setdefault(side, {})[rate_key(rate)] = predict(profile, layout, at_rate)
    return RatePredictions(
        made_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        profile_sha256=hashlib.sha256(profile_bytes).hexdigest(),
        traffic=config.traffic,
        slo=config.slo,
        requests=config.requests,
        seeds=config.seeds,
        layouts=layouts,
        points=points,
    )


def write_predictions(path: Path, predictions: RatePredictions) -> None:
    """The predictions as indented JSON (to be committed before the runs they predict)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(predictions), indent=1))


def read_predictions(path: Path) -> RatePredictions:
    """A predictions file, validated."""
    return msgspec.json.decode(path.read_bytes(), type=RatePredictions)
