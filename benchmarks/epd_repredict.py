"""Re-profile and re-predict the measured points of a stored epd_vs_colocated result, without measuring them again:
for when the profiler or the planner changed and the served stack did not. The run's own profile, predictions and
errors are kept beside the new ones (`*_at_run`), and the file says when each was taken.
Usage: python benchmarks/epd_repredict.py --tag _shaped3b [--series mix] [--profile-from profile.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import tempfile
from pathlib import Path

import msgspec
from epd_report import plot, prediction_errors, print_table  # sibling scripts (benchmarks/ is on sys.path)
from epd_series import make_series, traffic_of
from epd_vs_colocated import RESULTS, predictions, profile_shares

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.planning.profiles import read_profile


def repredict_series(series: dict, name: str, args: argparse.Namespace, prompts: int, logs: Path) -> None:
    """A new profile (or --profile-from) and the planner's prediction of every stored rate, in place."""
    with tempfile.TemporaryDirectory(prefix="epd-repredict-") as tmp:
        spec = make_series(False, Path(tmp), prompts, series["checkpoint"].split()[-1])[name]
    traffic = traffic_of(spec)
    model = ensure_checkpoint(args.family, spec.checkpoint)
    prof = read_profile(args.profile_from) if args.profile_from else profile_shares(model, traffic, logs, prompts)
    rates = [float(r) for r in series["epd"]["points"]]
    predicted = predictions(prof, traffic, rates, prompts)
    series["profile_at_run"] = series.get("profile_at_run", series["profile"])
    series["prediction_errors_at_run"] = series.get("prediction_errors_at_run", series["prediction_errors"])
    series["profile"] = msgspec.to_builtins(prof)
    for side in ("colocated", "epd"):
        series[side].setdefault("predicted_at_run", series[side].get("predicted", {}))
        series[side]["predicted"] = predicted[side]
    series["prediction_errors"] = prediction_errors(series)
    series["repredicted"] = (
        f"profile taken again and every point predicted again on "
        f"{datetime.date.today().isoformat()}; the measured points are the run's"
    )


def main() -> None:
    """Re-predict each named series of the stored result, rewrite its JSON and PNG, print the table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tag", required=True, help="the stored result's suffix (epd_vs_colocated<tag>.json)")
    ap.add_argument("--series", default="mix", help="comma-separated series to re-predict (those with a profile)")
    ap.add_argument("--profile-from", type=Path, default=None, help="use this profile instead of profiling again")
    ap.add_argument("--family", default="qwen2_5_vl", help="the offline checkpoints' family")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    path = RESULTS / f"epd_vs_colocated{args.tag}.json"
    results = json.loads(path.read_text())
    logs = RESULTS / f"epd_vs_colocated{args.tag}_logs"
    for name in args.series.split(","):
        repredict_series(results["series"][name], name, args, results["prompts_per_point"], logs / name / "reprofile")
        path.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"epd_vs_colocated{args.tag}.png")
    print_table(results)


if __name__ == "__main__":
    main()
