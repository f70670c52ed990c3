"""Eric's CPU per resent image: a multi-turn chat resends every image of the conversation at each turn; the raw-bytes
alias (--alias-entries) answers an image whose embedding is still in Eric's pool without decoding, preprocessing or
hashing it again.

Tiny Qwen2-VL (--size small: a tower of 8 blocks of 512), one Eric pinned to one core (--eric-core), the client on
another. Images: random_image (gradients plus noise) as JPEG and PNG at 448 and 1024 px, --images distinct ones per
format and size, 3 per POST /v1/encode at concurrency 1 (a chat's turn); every answer's leases are acknowledged (the
entries then stay as content cache, --keep-acked-bytes, large enough to keep every image). Per format and size: first
sight (every image new), then --turns resend turns (the same bytes again, each image once per turn). Baseline, same run:
the same Eric with --alias-entries 0 (a resend is decoded, preprocessed and hashed, then found in the pool by content
hash); ours: the default alias. Eric's CPU: utime+stime (/proc/<pid>/stat) of every process of its process group
(router, engine, worker) before and after each phase, divided by the images; the acks are measured apart. On-CPU time
from /proc/<pid>/task/*/schedstat (ns) is recorded beside as a cross-check. Target (issue): CPU per resent image with
the alias at least 20x below a first sight. Writes benchmarks/results/eric_repeat.{json,png}.
Usage: python benchmarks/eric_repeat.py [--images 48] [--turns 8] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import data_url, image_bytes, random_image
from eric_epd.wire.handles import LEASE_HEADER

logger = logging.getLogger("eric_repeat")
RESULTS = Path(__file__).parent / "results"
IMAGES_PER_REQUEST, TARGET_RATIO = 3, 20.0
SETS = {"jpeg_448": ("JPEG", 448), "png_448": ("PNG", 448), "jpeg_1024": ("JPEG", 1024), "png_1024": ("PNG", 1024)}
MIME = {"JPEG": "image/jpeg", "PNG": "image/png"}
KEEP_BYTES = 256 * 2**20
"""--keep-acked-bytes: far more than every image's rows (tiny Qwen2-VL resizes to at most 50176 px: 32 KiB each)."""
STAGE_RE = re.compile(r'^eric_stage_seconds_sum\{stage="(\w+)"\} (\S+)$', re.M)
ITEMS_RE = re.compile(r'^eric_items_total\{modality="image",source="(\w+)"\} (\S+)$', re.M)
HITS_RE = re.compile(r'^eric_alias_hits_total\{modality="image"\} (\S+)$', re.M)


def cpu_info() -> dict:
    """The CPU model and whether it has AVX-512 (avx512f, its other flags and AMX's listed) and AVX2, from lscpu."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {
        "model_name": fields.get("Model name", platform.processor()).strip(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "avx512_amx_flags": sorted(f for f in flags if f.startswith(("avx512", "amx"))),
        "cores": os.cpu_count(),
    }


def group_cpu(pgid: int) -> tuple[float, float]:
    """(utime+stime seconds from /proc/<pid>/stat, on-CPU seconds summed over /proc/<pid>/task/*/schedstat) of every
    process in process group `pgid`. The first counts threads that have ended too; the second is exact to the ns."""
    ticks, ns, hz = 0, 0, os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after the name: state, ppid, pgrp, ... utime (11), stime (12)
                continue
            ticks += int(fields[11]) + int(fields[12])
            for task in os.listdir(f"/proc/{entry}/task"):
                ns += int(Path(f"/proc/{entry}/task/{task}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # a process or thread that ended meanwhile
    return ticks / hz, ns / 1e9


def image_sets(n: int) -> dict[str, tuple[str, list[bytes]]]:
    """Per set name, (MIME type, `n` distinct encoded images); seeds differ across sets, so no two images match."""
    out = {}
    for s, (name, (fmt, side)) in enumerate(SETS.items()):
        out[name] = (MIME[fmt], [image_bytes(random_image(side, side, 1000 * s + i), fmt) for i in range(n)])
    return out


def bodies(mime: str, images: list[bytes]) -> list[bytes]:
    """The /v1/encode bodies (JSON, serialized once) sending `images` 3 at a time."""
    out = []
    for i in range(0, len(images), IMAGES_PER_REQUEST):
        chunk = images[i : i + IMAGES_PER_REQUEST]
        items = [{"id": str(i + k), "modality": "image", "url": data_url(b, mime)} for k, b in enumerate(chunk)]
        out.append(json.dumps({"items": items}).encode())
    return out


def scrape(eric: EricServer) -> dict:
    """The alias hits, image items by source and stage sums from the Eric's /metrics."""
    text = httpx.get(eric.url + "/metrics", timeout=10).text
    hits = HITS_RE.search(text)
    return {
        "alias_hits": float(hits.group(1)) if hits else 0.0,
        "items": {k: float(v) for k, v in ITEMS_RE.findall(text)},
        "stages_s": {k: float(v) for k, v in STAGE_RE.findall(text)},
    }


def delta(after: dict, before: dict, sign: float = -1.0) -> dict:
    """after - before key by key, nested dicts too (`sign` +1: their sum)."""
    keys = after.keys() | before.keys()
    return {
        k: delta(after.get(k, {}), before.get(k, {}), sign)
        if isinstance(after.get(k, before.get(k)), dict)
        else after.get(k, 0.0) + sign * before.get(k, 0.0)
        for k in sorted(keys)
    }


def timed(eric: EricServer, images: int, work) -> tuple[dict, object]:
    """Run `work()` between two readings of the Eric's CPU and metrics (the scrapes outside the CPU window): the
    phase's totals (images, CPU, wall time, metric deltas) and what `work` returned."""
    pgid = eric.proc.pid  # started in its own session: the group id is its pid
    before = scrape(eric)
    cpu0, start = group_cpu(pgid), time.perf_counter()
    result = work()
    wall, cpu1 = time.perf_counter() - start, group_cpu(pgid)
    moved = delta(scrape(eric), before)
    phase = {"images": images, "cpu_s": cpu1[0] - cpu0[0], "sched_cpu_s": cpu1[1] - cpu0[1], "wall_s": wall}
    return phase | moved, result


def finish(phases: list[dict], latencies: list[float] | None = None) -> dict:
    """Phases' totals summed, with CPU and stage ms per image (and the request p50 from `latencies`)."""
    total = phases[0]
    for phase in phases[1:]:
        total = delta(total, phase, sign=1.0)
    n = total["images"] = int(total["images"])
    total["cpu_ms_per_image"] = total["cpu_s"] * 1e3 / n
    total["sched_cpu_ms_per_image"] = total["sched_cpu_s"] * 1e3 / n
    total["stages_ms_per_image"] = {k: v * 1e3 / n for k, v in total.pop("stages_s").items() if v > 0}
    if latencies:
        total["request_p50_ms"] = float(np.median(latencies)) * 1e3
    return total


def encode(client: httpx.Client, eric: EricServer, requests: list[bytes]) -> tuple[list[dict], list[float]]:
    """POST each body in turn; every answered item and each request's latency."""
    answers, latencies = [], []
    for body in requests:
        start = time.perf_counter()
        resp = client.post(eric.url + "/v1/encode", content=body, headers={"Content-Type": "application/json"})
        latencies.append(time.perf_counter() - start)
        resp.raise_for_status()
        answers += resp.json()["items"]
    return answers, latencies


def ack(client: httpx.Client, eric: EricServer, answers: list[dict]) -> None:
    """End every answer's lease (the entries stay in the pool as content cache)."""
    for item in answers:
        handle = item["handle"]
        resp = client.post(
            f"{eric.url}/v1/embeddings/{item['hash']}/ack",
            headers={LEASE_HEADER: handle["lease"]},
            json={"instance_id": handle["instance_id"]},
        )
        resp.raise_for_status()


def run_eric(model: Path, alias: bool, sets: dict, args: argparse.Namespace) -> dict:
    """One Eric (the alias on or off): per set, first sight then `args.turns` resend turns, each turn's acks apart."""
    extra = (
        "--keep-acked-bytes",
        str(KEEP_BYTES),
        "--alias-entries",
        str(4096 if alias else 0),
        "--embedding-ttl",
        "3600",
    )
    name = "alias" if alias else "no_alias"
    out: dict = {"extra_args": list(extra), "sets": {}}
    log = RESULTS / f"eric_repeat_{name}{'' if args.size == 'tiny' else '_' + args.size}.log"
    with contextlib.ExitStack() as stack:
        eric = stack.enter_context(EricServer(model, cpus=(args.eric_core,), extra_args=extra, log_path=log))
        client = stack.enter_context(httpx.Client(timeout=120, headers=eric.headers))
        for s, (fmt, side) in enumerate(SETS.values()):  # warm-up: other images of every set, sent twice
            warm = bodies(
                MIME[fmt], [image_bytes(random_image(side, side, 9_000_000 + 10 * s + k), fmt) for k in range(3)]
            )
            for _ in range(2):
                ack(client, eric, encode(client, eric, warm)[0])
        idle, _ = timed(eric, 1, lambda: time.sleep(2.0))
        out["idle_cpu_s_per_s"] = idle["cpu_s"] / idle["wall_s"]
        for set_name, (mime, images) in sets.items():
            requests, n = bodies(mime, images), len(images)
            phases: dict[str, list[dict]] = {"first": [], "first_ack": [], "resend": [], "resend_ack": []}
            latencies: dict[str, list[float]] = {"first": [], "resend": []}
            for turn in range(1 + args.turns):
                kind = "first" if turn == 0 else "resend"
                phase, (answers, lat) = timed(eric, n, lambda r=requests: encode(client, eric, r))
                phases[kind].append(phase)
                latencies[kind] += lat
                phases[kind + "_ack"].append(timed(eric, n, lambda a=answers: ack(client, eric, a))[0])
            out["sets"][set_name] = {k: finish(v, latencies.get(k)) for k, v in phases.items()}
            first, resend = out["sets"][set_name]["first"], out["sets"][set_name]["resend"]
            logger.info(
                "%s %s: first sight %.2f ms/img, resend %.3f ms/img (alias hits %d of %d)",
                name,
                set_name,
                first["cpu_ms_per_image"],
                resend["cpu_ms_per_image"],
                resend["alias_hits"],
                resend["images"],
            )
    return out


def summarize(sets: dict, runs: dict) -> list[dict]:
    """One row per set: CPU ms per image of each phase and the first/resend ratios, with the target's verdict
    (the acks' cost where the run measured them apart: eric_repeat_sglang.py's SGLang protocol has none)."""
    rows = []
    for name, (_, images) in sets.items():
        base, ours = runs["no_alias"]["sets"][name], runs["alias"]["sets"][name]
        row = {
            "set": name,
            "kib_per_image": sum(map(len, images)) / len(images) / 1024,
            "first_ms_no_alias_run": base["first"]["cpu_ms_per_image"],
            "first_ms_alias_run": ours["first"]["cpu_ms_per_image"],
            "resend_ms_no_alias": base["resend"]["cpu_ms_per_image"],
            "resend_ms_alias": ours["resend"]["cpu_ms_per_image"],
            "ack_ms_alias": ours["resend_ack"]["cpu_ms_per_image"] if "resend_ack" in ours else None,
            "ratio_no_alias": base["first"]["cpu_ms_per_image"] / base["resend"]["cpu_ms_per_image"],
            "ratio_alias": ours["first"]["cpu_ms_per_image"] / ours["resend"]["cpu_ms_per_image"],
            "sched_ratio_alias": ours["first"]["sched_cpu_ms_per_image"] / ours["resend"]["sched_cpu_ms_per_image"],
            "p50_ms_first": ours["first"]["request_p50_ms"],
            "p50_ms_resend_no_alias": base["resend"]["request_p50_ms"],
            "p50_ms_resend_alias": ours["resend"]["request_p50_ms"],
            "alias_hits": ours["resend"]["alias_hits"],
            "resent_images": ours["resend"]["images"],
        }
        row["target_met"] = row["ratio_alias"] >= TARGET_RATIO
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Bars of CPU ms per image (log scale) per set: first sight, resend without and with the alias."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    x, width = np.arange(len(rows)), 0.27
    bars = [
        ("first sight", "first_ms_alias_run"),
        ("resend, no alias", "resend_ms_no_alias"),
        ("resend, alias", "resend_ms_alias"),
    ]
    for i, (label, key) in enumerate(bars):
        ax.bar(x + (i - 1) * width, [r[key] for r in rows], width, label=label)
    for xi, r in zip(x, rows):
        mark = "met" if r["target_met"] else "not met"
        ax.annotate(
            f"{r['ratio_alias']:.1f}x ({mark})\nno alias {r['ratio_no_alias']:.1f}x",
            (xi + width, r["resend_ms_alias"]),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(x, [f"{r['set']}\n{r['kib_per_image']:.0f} KiB" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("Eric CPU ms per image (router+engine+worker)")
    ax.set_title(f"Eric CPU per image: first sight vs resend (target: alias >= {TARGET_RATIO:g}x below first sight)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Run both Erics on the same images, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=48, help="distinct images per format and size (a multiple of 3)")
    ap.add_argument("--turns", type=int, default=8, help="resend turns: each resends every image of the set once")
    ap.add_argument("--quick", action="store_true", help="a short run: 24 images and 4 resend turns per set")
    ap.add_argument("--eric-core", type=int, default=0, help="CPU core Eric (all its processes) is pinned to")
    ap.add_argument("--client-core", type=int, default=1, help="CPU core for this client")
    ap.add_argument(
        "--size",
        choices=("tiny", "small"),
        default="tiny",
        help="checkpoint: tiny (a first sight is nearly all host work) or small (a tower of 8 blocks of 512, so a "
        "first sight costs what encoding costs); small writes eric_repeat_small.{json,png}",
    )
    args = ap.parse_args()
    if args.quick:
        args.images, args.turns = 24, 4
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.sched_setaffinity(0, {args.client_core})
    RESULTS.mkdir(exist_ok=True)
    model = ensure_checkpoint("qwen2_vl", args.size)
    out = "eric_repeat" + ("" if args.size == "tiny" else f"_{args.size}")
    sets = image_sets(args.images)
    started = time.time()
    runs = {"no_alias": run_eric(model, False, sets, args), "alias": run_eric(model, True, sets, args)}
    rows = summarize(sets, runs)
    results = {
        "config": {
            "model": f"qwen2_vl {args.size}",
            "images_per_set": args.images,
            "resend_turns": args.turns,
            "images_per_request": IMAGES_PER_REQUEST,
            "eric_core": args.eric_core,
            "client_core": args.client_core,
            "keep_acked_bytes": KEEP_BYTES,
            "cpu": cpu_info(),
            "wall_s": time.time() - started,
        },
        "target_ratio": TARGET_RATIO,
        "table": rows,
        "runs": runs,
    }
    (RESULTS / f"{out}.json").write_text(json.dumps(results, indent=2))
    plot(rows, RESULTS / f"{out}.png")
    head = f"{'set':<10} {'KiB':>6} {'first':>7} {'first*':>7} {'resend':>7} {'resend*':>8} {'ratio':>6} {'ratio*':>7}"
    lines = [
        f"{r['set']:<10} {r['kib_per_image']:6.0f} {r['first_ms_no_alias_run']:7.2f} {r['first_ms_alias_run']:7.2f} "
        f"{r['resend_ms_no_alias']:7.2f} {r['resend_ms_alias']:8.3f} {r['ratio_no_alias']:6.2f} "
        f"{r['ratio_alias']:7.1f} {'met' if r['target_met'] else 'NOT met'}"
        for r in rows
    ]
    logger.info(
        "Eric CPU ms per image (* = with the alias; ratio = first sight / resend; target %gx)\n%s\n%s",
        TARGET_RATIO,
        head,
        "\n".join(lines),
    )


if __name__ == "__main__":
    main()
