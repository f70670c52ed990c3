"""A projection, not a measurement: the planner's EPD-vs-colocated answer for Qwen2.5-VL-3B and -7B on 8 H100s, from
a roofline profile built from published hardware figures and the released configs' FLOPs (planning/costs.py).

Assumptions (stated in the JSON): H100 SXM dense bf16 989 TFLOP/s and 3.35 TB/s HBM3; the tower runs at 35% of peak,
prefill at 50%; a decode step reads every weight once at 70% of the bandwidth plus its FLOPs at 50% of peak, plus a
fixed 1.5 ms per step; Eric adds 8 ms of latency per request (HTTP, decoding and preprocessing on the host) and the
engine 10 ms outside its steps; the colocated engine's processor adds what Eric's preprocessing does. Replace it with
`eric-epd profile --device cuda` output where a GPU is at hand.
Host cores: how many host cores one GPU Eric needs to keep up with its tower (the tower's items/s at the roofline x
the host seconds an item costs), from the host cost a measured profile recorded (--host-from; its router stages per
image token, scaled to this traffic's images). A profile without them says so, and no figure is made up.
Writes benchmarks/results/gpu_projection.{json,png}.
Usage: python benchmarks/gpu_projection.py [--gpus 8] [--host-from PROFILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec

from eric_epd.planning.costs import REFERENCES, stage_costs
from eric_epd.planning.planner import PlanConfig, plan
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
)
from eric_epd.planning.simulate import tokens_per_item

RESULTS = Path(__file__).parent / "results"
PEAK_FLOPS, BANDWIDTH = 989e12, 3.35e12
MFU = {"tower": 0.35, "prefill": 0.5, "decode": 0.5}
BANDWIDTH_SHARE, STEP_S, ERIC_FIXED_S, ENGINE_OVERHEAD_S = 0.7, 1.5e-3, 8e-3, 10e-3
TRAFFIC = Traffic(images_per_request=4, sides=(448, 896), prompt_tokens=128, output_tokens=128)
IMAGE_TOKENS = {448: 256, 896: 1024}
SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0)
ITEM_TOKENS = sum(IMAGE_TOKENS[s] for s in TRAFFIC.sides) / len(TRAFFIC.sides)
"""Mean image tokens of an item of this traffic (each side equally likely)."""
HOST_FROM = RESULTS / "predictions" / "epd_vs_colocated_shaped3b_mix_profile.json"
NOT_MEASURED = "host cost not measured in this profile"


def weight_bytes(config: dict) -> float:
    """bf16 bytes a decode step reads: the language model's weights and its LM head."""
    costs = stage_costs(config)
    return costs.decode_per_token  # 2 FLOPs per weight, 2 bytes per bf16 weight


def tower_s_per_image_token(name: str) -> float:
    """Seconds of one image token in the tower of model `name` on one GPU, at the roofline above."""
    return stage_costs(REFERENCES[name]).encoder_per_image_token / (PEAK_FLOPS * MFU["tower"])


def host_cost(profile: Profile) -> dict:
    """The host seconds per item and per image token that `profile` measured on its smallest share (at the busiest
    point that measured them, Share.host_and_tower), or {"measured": False, "note": NOT_MEASURED}."""
    share = min(profile.shares, key=lambda s: len(s.devices))
    point = share.host_and_tower()
    if point is None or point.host_s_per_item <= 0:
        return {"measured": False, "note": NOT_MEASURED}
    tokens = tokens_per_item(profile)
    return {
        "measured": True,
        "model": profile.model,
        "device": profile.device,
        "share_devices": len(share.devices),
        "concurrency": point.concurrency,
        "sides": list(profile.traffic.sides),
        "host_s_per_item": point.host_s_per_item,
        "tower_s_per_item": point.tower_s_per_item,
        "image_tokens_per_item": tokens,
        "host_s_per_image_token": point.host_s_per_item / tokens,
    }


def host_cores(name: str, host: dict) -> dict:
    """What one GPU Eric of model `name` needs on the host to keep up with its tower on this traffic: the tower's
    items/s at the roofline x the host seconds per item (the measured host cost per image token x this traffic's
    image tokens per item), in cores; None where the profile did not measure the host cost."""
    per_item = ITEM_TOKENS
    tower_items_per_s = 1.0 / (per_item * tower_s_per_image_token(name))
    out: dict = {"tower_items_per_s": tower_items_per_s, "image_tokens_per_item": per_item}
    if not host["measured"]:
        return {**out, "host_s_per_item": None, "host_cores": None, "note": host["note"]}
    host_s_per_item = host["host_s_per_image_token"] * per_item
    return {**out, "host_s_per_item": host_s_per_item, "host_cores": tower_items_per_s * host_s_per_item}


def roofline_profile(name: str) -> Profile:
    """One GPU share per side, every figure from the roofline above."""
    config = REFERENCES[name]
    costs = stage_costs(config)
    tower_s = tower_s_per_image_token(name)
    prefill_s = costs.prefill_per_token / (PEAK_FLOPS * MFU["prefill"])
    per_item = ITEM_TOKENS
    items_per_s = 1.0 / (per_item * tower_s + ERIC_FIXED_S / TRAFFIC.images_per_request)
    lone = ERIC_FIXED_S + TRAFFIC.images_per_request * per_item * tower_s
    eric = [
        EricPoint(1, TRAFFIC.images_per_request / lone, lone, lone, TRAFFIC.images_per_request),
        EricPoint(8, items_per_s, 8 * TRAFFIC.images_per_request / items_per_s, 0.0, 16.0),
    ]

    def step(batch: int) -> float:
        return (
            STEP_S
            + weight_bytes(config) / (BANDWIDTH * BANDWIDTH_SHARE)
            + batch * costs.decode_per_token / (PEAK_FLOPS * MFU["decode"])
        )

    prefill = [
        PrefillPoint(n, ENGINE_OVERHEAD_S + step(1) + n * prefill_s, step(1) + n * prefill_s) for n in (128, 1024, 4096)
    ]
    decode = [DecodePoint(b, step(b)) for b in (1, 8, 32, 128, 256)]
    engine = EngineSide(prefill, decode, tower_s, ERIC_FIXED_S / (TRAFFIC.images_per_request * per_item))
    return Profile(
        name,
        "cuda (roofline projection)",
        "bfloat16",
        TRAFFIC,
        IMAGE_TOKENS,
        costs.ratios(),
        [Share((0,), eric, engine)],
        token_factor=28,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
    )


def project(name: str, gpus: int, rates: list[float]) -> dict:
    """The plan at each rate: best EPD layout, colocated on the same GPUs, and the ratios."""
    profile = roofline_profile(name)
    out = {}
    for rate in rates:
        traffic = msgspec.structs.replace(TRAFFIC, rate=rate)
        result = plan(
            profile, PlanConfig(gpus, traffic, SLO, requests=400, seeds=3, max_batched_tokens=8192, max_seqs=256)
        )
        out[str(rate)] = msgspec.to_builtins(result)
        lay = result.epd.layout
        print(
            f"{name} {rate:6.1f} req/s: EPD {lay.erics} Eric + {lay.engines} engines | "
            + ", ".join(f"{k} {v:.2f}x" for k, v in result.ratios.items())
        )
    return out


def plot(results: dict, path: Path) -> None:
    """EPD / colocated ratios against rate, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["models"]), figsize=(6 * len(results["models"]), 4), squeeze=False)
    for ax, (name, by_rate) in zip(axes[0], results["models"].items()):
        rates = [float(r) for r in by_rate]
        for key in ("throughput", "ttft_p50", "tpot_p99", "goodput"):
            ax.plot(rates, [min(by_rate[r]["ratios"][key], 10) for r in by_rate], "o-", label=key)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{name}, {results['gpus']} H100 (projection)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("EPD / colocated")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    """Project both models over a sweep of rates; write the JSON and PNG."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in all")
    ap.add_argument("--rates", default="40,60,80,100,120", help="comma-separated requests/s")
    ap.add_argument(
        "--host-from",
        type=Path,
        default=HOST_FROM,
        help="a profile JSON from `eric-epd profile` whose measured host seconds per item (Eric's router stages) "
        "give the host cores one GPU Eric needs at its tower rate (default: the committed shaped3b mix profile)",
    )
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    host = host_cost(read_profile(args.host_from))
    cores = {name: host_cores(name, host) for name in REFERENCES}
    for name, c in cores.items():
        need = f"{c['host_cores']:.1f} host cores" if c["host_cores"] is not None else c["note"]
        print(f"{name}: tower {c['tower_items_per_s']:.0f} items/s on one GPU; {need}")
    results = {
        "projection": True,
        "gpus": args.gpus,
        "assumptions": {
            "peak_bf16_flops": PEAK_FLOPS,
            "hbm_bytes_per_s": BANDWIDTH,
            "mfu": MFU,
            "bandwidth_share": BANDWIDTH_SHARE,
            "decode_step_fixed_s": STEP_S,
            "eric_fixed_s": ERIC_FIXED_S,
            "engine_overhead_s": ENGINE_OVERHEAD_S,
            "max_batched_tokens": 8192,
            "max_seqs": 256,
            "host_cost_scales_with": "image tokens per item (the profile's mix to this traffic's)",
        },
        "host_from": str(args.host_from),
        "host_cost": host,
        "host_cores": cores,
        "traffic": msgspec.to_builtins(TRAFFIC),
        "slo": msgspec.to_builtins(SLO),
        "models": {name: project(name, args.gpus, rates) for name in REFERENCES},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_projection.json").write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / "gpu_projection.png")


if __name__ == "__main__":
    main()
