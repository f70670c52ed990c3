"""The planner's predictions of the shaped runs were made before the runs and are compared strictly: each committed
predictions file (benchmarks/results/predictions/, written by `eric-epd plan --rates`) predates the run that measured
its rates, is the one the run used, and the README's count is recomputed here from the raw runs."""

from __future__ import annotations

import datetime
import hashlib
import json
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.support import readme_planner as planner

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TAGS = ("_shaped3b", "_shaped7b")


def _load(tag: str) -> tuple[dict, dict, bytes]:
    series = json.loads((RESULTS / f"epd_vs_colocated{tag}.json").read_text())["series"]["mix"]
    first = ROOT / series["predictions_file"]
    profile = first.with_name(first.stem + "_profile.json").read_bytes()
    return series, json.loads(first.read_text()), profile


def _when(stamp: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(stamp)


def _added_at(path: Path) -> datetime.datetime | None:
    """When git first committed `path` (None in a shallow clone, whose history may not reach it)."""
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    if shallow.stdout.strip() == "true":
        return None
    log = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%cI", "--", str(path.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert log, f"{path} was never committed"
    return _when(log[-1])


def strict_count(series: dict, predicted: dict) -> tuple[int, int]:
    """Hits (within 15% of the median of the raw runs) and figures, from the runs alone (no stored medians)."""
    hits = total = 0
    for side in planner.SIDES:
        for rate, runs in series[side]["runs"].items():
            for key, path in planner.MEASURES.items():
                value = predicted[side][rate]
                for part in path:
                    value = value[part]
                median = statistics.median(r[key] for r in runs)
                total += 1
                hits += abs(value / median - 1.0) <= planner.LIMIT
    return hits, total


@pytest.mark.parametrize("tag", TAGS)
def test_predictions_predate_the_run_that_used_them(tag: str) -> None:
    series, first, profile = _load(tag)
    assert hashlib.sha256(profile).hexdigest() == first["profile_sha256"]
    assert json.loads(profile) == series["profile"], "the run's profile is not the one its predictions came from"
    assert series["epd"]["predicted"] == first["points"]["epd"]
    assert series["colocated"]["predicted"] == first["points"]["colocated"]
    assert sorted(series["epd"]["runs"]) == sorted(first["points"]["epd"]), "the run measured other rates"
    made = _when(first["made_at"])
    for side in planner.SIDES:
        assert made < _when(series[side]["started_at"]), f"{side} started before the predictions were made"
    committed = _added_at(ROOT / series["predictions_file"])
    if committed is not None:
        assert committed < _when(series["colocated"]["started_at"]), "the predictions were committed after the run"


@pytest.mark.parametrize("tag", TAGS)
def test_strict_count_recomputed_from_raw_runs(tag: str) -> None:
    series, first, _ = _load(tag)
    hits, total = strict_count(series, first["points"])
    errors = planner.recompute(series, "")
    assert (hits, total) == (sum(map(planner.hit, errors)), len(errors))
    assert planner.stored_disagreements(series, "") == []
    assert f"{hits} of {total} within 15%" in (ROOT / "README.md").read_text()
    # negative control: the other series' predictions (another checkpoint's) are not counted as well
    other = json.loads((RESULTS / "predictions" / f"epd_vs_colocated{TAGS[1 - TAGS.index(tag)]}_mix.json").read_text())
    other = other["points"]
    shifted = {side: {r: other[side][min(other[side])] for r in first["points"][side]} for side in planner.SIDES}
    assert strict_count(series, shifted)[0] < hits
