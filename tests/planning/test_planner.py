"""The planner's model on hand-made profiles, where its answers follow by arithmetic: one request's TTFT, the
colocated encoder's share of a step, saturated throughput as the slower side's capacity, and the layouts tried."""

from __future__ import annotations

import msgspec
import pytest

from eric_epd.planning.planner import Layout, PlanConfig, colocated_layout, epd_layouts, plan, predict
from eric_epd.planning.profiles import (
    DecodePoint,
    EngineSide,
    EricPoint,
    PrefillPoint,
    Profile,
    Share,
    Slo,
    Traffic,
    read_profile,
    write_profile,
)

TOKENS = {224: 64, 448: 256}


def _profile(
    eric_items_per_s: float = 10.0, encoder_s_per_token: float = 1e-3, sizes: tuple[int, ...] = (1, 2)
) -> Profile:
    """Eric: 10 items/s of 224 px (640 tokens/s) and 0.2 s for a lone 2-image request (0.0 s fixed); the engine:
    prefill 0.05 s + 1 ms per token, TPOT 10 ms alone, 20 ms at 8."""
    eric = [
        EricPoint(1, eric_items_per_s / 2, 2 / eric_items_per_s, 2 / eric_items_per_s, 2.0),
        EricPoint(8, eric_items_per_s, 1.0, 1.2, 8.0),
    ]
    engine = EngineSide(
        [PrefillPoint(100, 0.15), PrefillPoint(300, 0.35)],
        [DecodePoint(1, 0.01), DecodePoint(8, 0.02)],
        encoder_s_per_token,
    )
    shares = [Share(tuple(range(n)), eric, engine) for n in sizes]
    return Profile("m", "cpu", "float32", Traffic(2, (224,)), TOKENS, {}, shares)


def _config(rate: float = 0.0, requests: int = 1, images: int = 2, output: int = 11) -> PlanConfig:
    return PlanConfig(2, Traffic(images, (224,), 36, output, rate), Slo(10_000, 1_000), requests=requests, seeds=1)


def test_one_request_ttft_is_the_sum_of_its_stages() -> None:
    """EPD: Eric (128 tokens at 640/s) + one step (10 ms + 164 tokens x 1 ms) + the request overhead (the fit's
    50 ms intercept beyond a 10 ms step); colocated: the same step plus its own encoder (128 x 1 ms), no Eric."""
    prof = _profile()
    epd = predict(prof, Layout(1, 1, 1, 1), _config())
    assert epd.ttft_ms["p50"] == pytest.approx(1e3 * (128 / 640 + 0.01 + 0.164 + 0.04))
    assert epd.tpot_ms["p50"] == pytest.approx(10.0)
    col = predict(prof, Layout(0, 0, 1, 1), _config())
    assert col.ttft_ms["p50"] == pytest.approx(1e3 * (0.01 + 0.164 + 0.128 + 0.04))


def test_decode_steps_cost_more_at_longer_contexts() -> None:
    """Profiled at two contexts (10 ms after 0 tokens, 20 ms after 1000), a step costs linearly in between at its
    requests' mean context: one request of 164 prompt tokens decodes its 10 tokens at contexts 165..174."""
    side = EngineSide(
        [PrefillPoint(100, 0.15), PrefillPoint(300, 0.35)],
        [DecodePoint(1, 0.01, 0), DecodePoint(8, 0.02, 0), DecodePoint(1, 0.02, 1000), DecodePoint(8, 0.04, 1000)],
        1e-3,
    )
    prof = msgspec.structs.replace(_profile(), shares=[Share((0,), _profile().shares[0].eric, side)])
    epd = predict(prof, Layout(1, 1, 1, 1), _config())
    assert epd.tpot_ms["p50"] == pytest.approx(10.0 + 10.0 * 169.5 / 1000)


def test_engine_timed_points_split_engine_work_from_the_rest() -> None:
    """With vLLM's own prefill times in the points, the fit runs on those (1 ms per token) and the rest of each
    request's wait (30 ms here) is its overhead; colocated, the processor's 0.5 ms per raw image token comes first."""
    side = EngineSide(
        [PrefillPoint(100, 0.14, 0.11), PrefillPoint(300, 0.34, 0.31)],
        [DecodePoint(1, 0.01), DecodePoint(8, 0.02)],
        1e-3,
        own_preprocess_s_per_image_token=5e-4,
    )
    prof = msgspec.structs.replace(
        _profile(),
        shares=[Share((0,), _profile().shares[0].eric, side), Share((0, 1), _profile().shares[0].eric, side)],
    )
    epd = predict(prof, Layout(1, 1, 1, 1), _config())
    assert epd.ttft_ms["p50"] == pytest.approx(1e3 * (128 / 640 + 0.01 + 0.164 + 0.03))
    col = predict(prof, Layout(0, 0, 1, 1), _config())
    assert col.ttft_ms["p50"] == pytest.approx(1e3 * (0.064 + 0.01 + 0.164 + 0.128 + 0.03))


def test_saturated_throughput_is_the_slower_sides_capacity() -> None:
    """Eric at 1 item/s is the bottleneck (2 images a request: 0.5 req/s); at 1,000 items/s the engine is, and EPD
    then beats colocated, whose engine also encodes."""
    slow = predict(_profile(eric_items_per_s=1.0), Layout(1, 1, 1, 1), _config(requests=200))
    assert slow.request_throughput == pytest.approx(0.5, rel=0.02)
    fast = _profile(eric_items_per_s=1000.0)
    epd = predict(fast, Layout(1, 1, 1, 1), _config(requests=200))
    col = predict(fast, Layout(0, 0, 1, 1), _config(requests=200))
    assert epd.request_throughput > 1.5 * col.request_throughput


def test_plan_picks_the_best_layout_and_reports_both_modes() -> None:
    result = plan(_profile(eric_items_per_s=1000.0), _config(rate=2.0, requests=100))
    assert result.epd.layout == Layout(1, 1, 1, 1, 2048)
    assert result.colocated.layout == Layout(0, 0, 1, 2, 2048)
    assert result.ratios["throughput"] == pytest.approx(
        result.epd.request_throughput / result.colocated.request_throughput
    )
    assert {p.layout for p in result.candidates} == {
        msgspec.structs.replace(lay, max_batched_tokens=2048) for lay in epd_layouts(_profile(), 2)
    }


def test_plan_tries_token_budgets_and_keeps_the_best() -> None:
    """With a tight TPOT bound, long prompts and a prefill that costs 1 ms a token, a 2048-token step holds decode
    for 1.5 s: EPD picks 64 tokens a step (better goodput and TPOT p99); colocated keeps whichever of its budgets
    serves it best (its own encoder still holds whole steps); every budget was simulated for both."""
    config = PlanConfig(
        2, Traffic(2, (224,), 1400, 64, rate=0.3), Slo(20_000, 60), requests=60, seeds=2, batched_token_choices=(64,)
    )
    result = plan(_profile(eric_items_per_s=1000.0), config)
    assert result.epd.layout.max_batched_tokens == 64
    colocated = [predict(_profile(eric_items_per_s=1000.0), Layout(0, 0, 1, 2, b), config) for b in (64, 2048)]
    assert result.colocated == max(colocated, key=lambda p: (p.request_goodput, p.request_throughput))
    assert sorted({p.layout.max_batched_tokens for p in result.candidates}) == [64, 2048]
    big = predict(
        _profile(eric_items_per_s=1000.0), msgspec.structs.replace(result.epd.layout, max_batched_tokens=2048), config
    )
    assert result.epd.request_goodput > big.request_goodput and result.epd.tpot_ms["p99"] < big.tpot_ms["p99"]


def test_layouts_on_eight_gpus() -> None:
    """Shares of 1 and 2 GPUs on 8: every mix with at least one Eric and one engine, filling the devices."""
    layouts = epd_layouts(_profile(sizes=(1, 2)), 8)
    assert Layout(1, 1, 7, 1) in layouts and Layout(6, 1, 1, 2) in layouts and Layout(2, 2, 2, 2) in layouts
    assert all(lay.erics * lay.eric_devices + lay.engines * lay.engine_devices <= 8 for lay in layouts)
    assert colocated_layout(_profile(sizes=(1, 2)), 8) == Layout(0, 0, 4, 2)
    with pytest.raises(ValueError, match="fit no Eric"):
        epd_layouts(_profile(sizes=(2,)), 2)


def test_profile_file_round_trip_and_validation(tmp_path) -> None:
    path = tmp_path / "p.json"
    write_profile(_profile(), path)
    assert read_profile(path) == _profile()
    path.write_text(path.read_text().replace('"images_per_request"', '"images_per_req"'))
    with pytest.raises(msgspec.ValidationError, match="images_per_req"):
        read_profile(path)
    with pytest.raises(ValueError, match="sides between"):
        Traffic(1, (10,))
    assert _profile().image_tokens_for(Traffic(1, (224, 896))) == {224: 64, 896: 1024}


def _scaling_profile() -> Profile:
    """Shares of 1-3 CPUs where both sides' speed is proportional to their CPUs: Eric 4 items/s of 64 tokens per
    CPU; the engine 1 ms per prefill token and a 10 ms step, divided by its CPUs."""
    shares = []
    for n in (1, 2, 3):
        eric = [EricPoint(1, 2.0 * n, 0.5 / n, 0.5 / n, 2.0), EricPoint(8, 4.0 * n, 1.0, 1.2, 8.0)]
        engine = EngineSide(
            [PrefillPoint(100, 0.11 / n), PrefillPoint(300, 0.31 / n)],
            [DecodePoint(1, 0.01 / n), DecodePoint(8, 0.02 / n)],
            1e-3 / n,
        )
        shares.append(Share(tuple(range(n)), eric, engine))
    return Profile("m", "cpu", "float32", Traffic(2, (224,)), TOKENS, {}, shares)


def test_up_gives_eric_the_cpus_the_plan_says(tmp_path, monkeypatch) -> None:
    """On 4 CPUs, image-heavy traffic gets Eric 3 of them (8 s of tower work a request on one CPU against 2.1 s of
    prefill) and text-heavy traffic 1 (0.25 s against 1.6 s); `eric-epd up --plan-from` takes the count planned for
    the profiled mix, `--eric-cpus` the one given, and a count that leaves a side without a CPU is refused."""
    from eric_epd.planning.planner import eric_share_for_host
    from eric_epd.stack import up

    prof, slo = _scaling_profile(), Slo(5_000, 200)
    heavy = Traffic(8, (448,), 32, 8, rate=0.3)
    light = Traffic(1, (224,), 1500, 64, rate=0.5)
    assert eric_share_for_host(prof, 4, heavy, slo) == 3
    assert eric_share_for_host(prof, 4, light, slo) == 1
    assert eric_share_for_host(prof, 4, prof.traffic, slo) == 3  # the profiled mix, 2 images of 224 px: Eric-bound
    path = tmp_path / "p.json"
    write_profile(prof, path)
    monkeypatch.setattr(up, "available_cpus", lambda: (0, 1, 2, 3))
    assert up.split_for(up.UpConfig(model=tmp_path, plan_from=path, slo=(5_000, 200))) == ((0, 1, 2), (3,))
    assert up.split_for(up.UpConfig(model=tmp_path, eric_cpus=1)) == ((0,), (1, 2, 3))
    with pytest.raises(ValueError, match="between 1 and 3"):
        up.split_for(up.UpConfig(model=tmp_path, eric_cpus=4))


def test_plan_writes_its_predictions_at_each_rate_before_any_run(tmp_path) -> None:
    """`eric-epd plan --rates ... --predictions F` (the real CLI, in a subprocess): each side's layout and its
    prediction at every rate, the same as predict() at that rate, stamped with the time and the profile's sha256;
    --rates without --predictions is refused."""
    import datetime
    import hashlib
    import subprocess
    import sys

    from eric_epd.planning.predictions import read_predictions

    profile, out = tmp_path / "p.json", tmp_path / "predicted.json"
    write_profile(_profile(eric_items_per_s=1000.0), profile)
    base = [sys.executable, "-m", "eric_epd", "plan", "--profile", str(profile), "--ttft-ms", "10000"]
    base += ["--tpot-ms", "1000", "--images", "2", "--sides", "224", "--prompt-tokens", "36", "--output-tokens", "11"]
    base += ["--requests", "20", "--seeds", "1", "--devices", "2"]
    before = datetime.datetime.now(datetime.UTC)
    subprocess.run([*base, "--rates", "2,inf", "--predictions", str(out)], check=True, capture_output=True)
    got = read_predictions(out)
    assert before.replace(microsecond=0) <= datetime.datetime.fromisoformat(got.made_at)
    assert got.profile_sha256 == hashlib.sha256(profile.read_bytes()).hexdigest()
    assert got.layouts == {"epd": Layout(1, 1, 1, 1, 2048), "colocated": Layout(0, 0, 1, 2, 2048)}
    assert sorted(got.points["epd"]) == ["2.0", "inf"]
    config = PlanConfig(2, Traffic(2, (224,), 36, 11, 2.0), Slo(10_000, 1_000), requests=20, seeds=1)
    assert got.points["colocated"]["2.0"] == predict(
        _profile(eric_items_per_s=1000.0), got.layouts["colocated"], config
    )
    assert got.points["epd"]["2.0"] != got.points["epd"]["inf"]  # the rate reached the simulation
    refused = subprocess.run([*base, "--rates", "2"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--rates and --predictions go together" in refused.stderr
