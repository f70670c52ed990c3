"""Eric's cost per item split between the host (its router's stages) and the vision tower: read from two scrapes of
eric_stage_seconds (hand-written text, and what Eric's own metrics render), shown per share by `eric-epd plan`, and
turned by benchmarks/gpu_projection.py into the host cores one GPU Eric needs at its tower rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import gpu_projection as gp
from eric_epd.common.prometheus import totals, totals_by_label
from eric_epd.eric.metrics import STAGES, EricMetrics
from eric_epd.planning.costs import REFERENCES, stage_costs
from eric_epd.planning.measure_eric import HOST_STAGES, TOWER_STAGES, host_tower_split
from eric_epd.planning.planner import render_host_split
from eric_epd.planning.profiles import EngineSide, EricPoint, Profile, Share, Traffic, read_profile

ROOT = Path(__file__).resolve().parents[2]
OLD_PROFILE = ROOT / "benchmarks/results/predictions/epd_vs_colocated_shaped3b_mix_profile.json"


def _exposition(stages: dict[str, tuple[int, float]]) -> str:
    """Prometheus text as Eric serves it: eric_stage_seconds (count, sum) per stage, beside another histogram and
    the _created samples some clients add, which the split must not read."""
    lines = [
        "# HELP eric_batch_items Items per batch",
        "# TYPE eric_batch_items histogram",
        'eric_batch_items_sum{modality="image"} 99.0',
        'eric_batch_items_count{modality="image"} 9.0',
        "# HELP eric_stage_seconds Time per stage of the encode path",
        "# TYPE eric_stage_seconds histogram",
    ]
    for stage, (count, total) in stages.items():
        lines += [
            f'eric_stage_seconds_bucket{{stage="{stage}",le="+Inf"}} {count}.0',
            f'eric_stage_seconds_count{{stage="{stage}"}} {count}.0',
            f'eric_stage_seconds_sum{{stage="{stage}"}} {total}',
            f'eric_stage_seconds_created{{stage="{stage}"}} 1.7e+09',
        ]
    return "\n".join(lines) + "\n"


BEFORE = {stage: (3, 1.5) for stage in STAGES}
GAINED = {
    "body_read": (1, 0.004),
    "fetch": (4, 0.008),
    "decode": (4, 0.040),
    "preprocess": (4, 0.020),
    "hash": (4, 0.004),
    "pool_reserve": (1, 1.0),  # a wait for room, not host work
    "engine_queue": (1, 3.0),  # a wait for the engine
    "batch_compute": (2, 0.400),
    "pool_write": (2, 0.5),  # the engine's copy into the pool
    "answer": (1, 0.004),
}


def test_split_from_two_hand_written_scrapes() -> None:
    """4 items arrived (fetch's count): the host stages gained 80 ms in all (20 ms an item), the tower 400 ms (100 ms
    an item); the waits and the pool copy are in neither; nothing gained, nothing to split."""
    before = _exposition(BEFORE)
    after = _exposition({s: (BEFORE[s][0] + GAINED[s][0], BEFORE[s][1] + GAINED[s][1]) for s in STAGES})
    split = host_tower_split(before, after)
    assert split.items == 4
    assert split.host_s_per_item == pytest.approx(0.080 / 4)
    assert split.tower_s_per_item == pytest.approx(0.400 / 4)
    assert split.stages_s_per_item["decode"] == pytest.approx(0.010)
    assert set(split.stages_s_per_item) == {*HOST_STAGES, *TOWER_STAGES}
    assert totals(after, "eric_batch_items") == (99.0, 9.0)  # the other histogram is read apart
    assert totals_by_label(after, "eric_stage_seconds", "stage")["fetch"] == pytest.approx((1.508, 7.0))
    idle = host_tower_split(before, before)
    assert (idle.items, idle.host_s_per_item, idle.tower_s_per_item) == (0, 0, 0)


def test_split_reads_the_stages_eric_exports() -> None:
    """The stage names are Eric's own (planning/ may not import eric/, so they are written twice), and the split
    reads what EricMetrics renders: two items' fetch, decode, preprocess and hash, one request's body and answer, one
    batch's forward."""
    assert set(HOST_STAGES) | set(TOWER_STAGES) <= set(STAGES)
    metrics = EricMetrics()
    before = metrics.render().decode()
    for _ in range(2):
        metrics.observe_item(0.001, (0.010, 0.020, 0.003))
    metrics.stages.observe("body_read", 0.002)
    metrics.stages.observe("answer", 0.002)
    metrics.stages.observe("pool_reserve", 0.5)
    metrics.stages.observe("batch_compute", 0.300)
    split = host_tower_split(before, metrics.render().decode())
    assert split.items == 2
    assert split.host_s_per_item == pytest.approx((2 * 0.034 + 0.004) / 2)
    assert split.tower_s_per_item == pytest.approx(0.150)


def _share(size: int, host: float, tower: float = 0.05) -> Share:
    points = [
        EricPoint(1, 5.0, 0.8, 0.9, 4.0, host_s_per_item=9.0, tower_s_per_item=9.0),
        EricPoint(8, 6.0, 5.0, 6.0, 6.0, host_s_per_item=host, tower_s_per_item=tower),
    ]
    engine = EngineSide([], [], 1e-3)
    return Share(tuple(range(size)), points, engine)


def _profile(shares: list[Share]) -> Profile:
    return Profile("m", "cpu", "float32", Traffic(4, (224, 448)), {224: 64, 448: 256}, {}, shares)


def test_old_profiles_read_and_say_the_split_was_not_measured() -> None:
    """A committed profile from before the split still reads: no point measured it, and the plan says so."""
    old = read_profile(OLD_PROFILE)
    assert all(p.host_s_per_item == p.tower_s_per_item == 0.0 for s in old.shares for p in s.eric)
    assert all(s.host_and_tower() is None for s in old.shares)
    assert "host and tower cost not measured in this profile" in render_host_split(old)
    rendered = render_host_split(_profile([_share(2, 0.02), _share(1, 0.032)]))
    assert "1 cpu device(s): host 32.0 ms, tower 50.0 ms (host / tower 0.64) at concurrency 8" in rendered


def test_projection_host_cores_from_a_measured_profile() -> None:
    """The smallest share's busiest point: 32 ms an item of 160 image tokens (224/448 px) is 0.2 ms a token; the
    projection's items are 640 tokens (448/896 px), 128 ms of host each; one GPU's tower at 35% of H100 peak
    encodes 1 / (640 x its seconds per token) items/s; the cores are the product."""
    host = gp.host_cost(_profile([_share(2, 0.02), _share(1, 0.032)]))
    assert host["measured"] and host["share_devices"] == 1 and host["concurrency"] == 8
    assert host["image_tokens_per_item"] == 160 and host["host_s_per_image_token"] == pytest.approx(0.032 / 160)
    for name in REFERENCES:
        tower_s = stage_costs(REFERENCES[name]).encoder_per_image_token / (989e12 * 0.35)
        got = gp.host_cores(name, host)
        assert got["tower_items_per_s"] == pytest.approx(1 / (640 * tower_s))
        assert got["host_s_per_item"] == pytest.approx(0.128)
        assert got["host_cores"] == pytest.approx(0.128 / (640 * tower_s))
    unmeasured = gp.host_cores(next(iter(REFERENCES)), gp.host_cost(read_profile(OLD_PROFILE)))
    assert unmeasured["host_cores"] is None and unmeasured["note"] == "host cost not measured in this profile"
