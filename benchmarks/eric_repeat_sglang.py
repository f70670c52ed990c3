"""Eric's CPU per resent image through SGLang's own encoder protocol: a real `sglang.launch_server --language-only
--encoder-urls <Eric>` (SGLang's torch-native CPU paths, zmq_to_scheduler) asks Eric for every image of every chat
turn, and a multi-turn chat resends the earlier images each turn.

Tiny Qwen2-VL, one Eric pinned to --eric-core, SGLang and this client on --sglang-core. Images: eric_repeat.py's
sets (random_image as JPEG and PNG at 448 and 1024 px; tiny Qwen2-VL resizes each to 64 tokens), 3 per chat (1
output token) at concurrency 1. Per set: first sight (every image new), then --turns resend turns (the same bytes
again). Baseline, same run: the same pair with Eric's --alias-entries 0 (a resend is decoded, preprocessed and hashed
again, then found by its content hash); ours: the default alias. Eric's CPU: utime+stime of its process group
(router, engine, worker) around each turn, divided by the images; SGLang's work is not in it. Target (issue 51): a
resent image at least 20x below a first sight "through SGLang's protocol" too.
Writes benchmarks/results/eric_repeat_sglang.{json,png}.
Usage: python benchmarks/eric_repeat_sglang.py [--images 24] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import httpx
from eric_repeat import (  # a sibling script (benchmarks/ is on sys.path)
    IMAGES_PER_REQUEST,
    KEEP_BYTES,
    RESULTS,
    TARGET_RATIO,
    cpu_info,
    finish,
    image_sets,
    plot,
    timed,
)
from eric_repeat import summarize as repeat_rows  # its rows, extended below

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.process import running
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import data_url
from eric_epd.testing.sglang_cpu import SglangServe

logger = logging.getLogger("eric_repeat_sglang")
IDLE_S = 15.0
"""Seconds Eric is watched idle before and after the sets: what it burns then is subtracted as `net`."""
ERIC_FLAGS = ("--dtype", "float32", "--sglang-dtype", "float32", "--sglang-allowed-peer", "127.0.0.1/32")
"""The language-only server runs float32 (SGLang's CPU paths); it connects from 127.0.0.1."""


def chats(mime: str, images: list[bytes]) -> list[dict]:
    """The chat bodies sending `images` 3 at a time as data URLs, 1 greedy output token each."""
    out = []
    for i in range(0, len(images), IMAGES_PER_REQUEST):
        parts: list[dict] = [
            {"type": "image_url", "image_url": {"url": data_url(b, mime)}} for b in images[i : i + IMAGES_PER_REQUEST]
        ]
        parts.append({"type": "text", "text": "What differs?"})
        out.append({"messages": [{"role": "user", "content": parts}], "max_tokens": 1, "temperature": 0.0})
    return out


def ask(client: httpx.Client, sglang: SglangServe, bodies: list[dict]) -> list[float]:
    """POST each chat in turn to SGLang; each request's latency (raises on an error status)."""
    latencies = []
    for body in bodies:
        start = time.perf_counter()
        client.post(sglang.url + "/v1/chat/completions", json=body).raise_for_status()
        latencies.append(time.perf_counter() - start)
    return latencies


def run_pair(model: Path, alias: bool, sets: dict, args: argparse.Namespace) -> dict:
    """One Eric (the alias on or off) behind one language-only SGLang: per set, first sight then resend turns."""
    extra = (*ERIC_FLAGS, "--keep-acked-bytes", str(KEEP_BYTES), "--alias-entries", str(4096 if alias else 0))
    name = "alias" if alias else "no_alias"
    logs = RESULTS / "eric_repeat_sglang_logs"
    logs.mkdir(exist_ok=True)
    eric = EricServer(model, cpus=(args.eric_core,), extra_args=extra, log_path=logs / f"eric-{name}.log")
    sglang = SglangServe(model, logs / f"sglang-{name}.log", (eric.url,), "zmq_to_scheduler", cpus=(args.sglang_core,))
    out: dict = {"extra_args": list(extra), "sets": {}}
    with running(eric, sglang), httpx.Client(timeout=300) as client:
        for mime, images in sets.values():  # warm-up: every set's first 3 images (not measured)
            ask(client, sglang, chats(mime, images[:IMAGES_PER_REQUEST][::-1]))
        idle = [timed(eric, 1, lambda: time.sleep(IDLE_S))[0]]
        for set_name, (mime, images) in sets.items():
            bodies, n = chats(mime, images[IMAGES_PER_REQUEST:]), len(images) - IMAGES_PER_REQUEST
            phases: dict[str, list[dict]] = {"first": [], "resend": []}
            latencies: dict[str, list[float]] = {"first": [], "resend": []}
            for turn in range(1 + args.turns):
                kind = "first" if turn == 0 else "resend"
                phase, lat = timed(eric, n, lambda b=bodies: ask(client, sglang, b))
                phases[kind].append(phase)
                latencies[kind] += lat
            out["sets"][set_name] = {k: finish(v, latencies[k]) for k, v in phases.items()}
            first, resend = out["sets"][set_name]["first"], out["sets"][set_name]["resend"]
            logger.info(
                "%s %s: first sight %.2f ms/img, resend %.3f ms/img (alias hits %d of %d; items %s)",
                name,
                set_name,
                first["cpu_ms_per_image"],
                resend["cpu_ms_per_image"],
                resend["alias_hits"],
                resend["images"],
                resend["items"],
            )
        idle.append(timed(eric, 1, lambda: time.sleep(IDLE_S))[0])
    out["idle_cpu_s_per_s"] = sum(p["sched_cpu_s"] for p in idle) / sum(p["wall_s"] for p in idle)
    return out


def net_ms(phase: dict, idle_rate: float) -> float:
    """Eric's on-CPU ms per image in `phase` beyond what it burns idle over the phase's wall time (its heartbeat
    and polls, while SGLang prefills)."""
    return (phase["sched_cpu_s"] - idle_rate * phase["wall_s"]) * 1e3 / phase["images"]


def summarize(sets: dict, runs: dict) -> list[dict]:
    """eric_repeat's rows (CPU ms per image, first sight against resent, with and without the alias), with Eric's
    on-CPU ms per image beyond its idle burn and the wall time per resent image beside them."""
    rows = repeat_rows(sets, runs)
    for row in rows:
        base, ours = runs["no_alias"]["sets"][row["set"]], runs["alias"]["sets"][row["set"]]
        idle_base, idle_ours = runs["no_alias"]["idle_cpu_s_per_s"], runs["alias"]["idle_cpu_s_per_s"]
        row |= {
            "idle_cpu_s_per_s": idle_ours,
            "resend_wall_ms_per_image": ours["resend"]["wall_s"] * 1e3 / ours["resend"]["images"],
            "first_net_ms_alias_run": net_ms(ours["first"], idle_ours),
            "resend_net_ms_alias": net_ms(ours["resend"], idle_ours),
            "resend_net_ms_no_alias": net_ms(base["resend"], idle_base),
        }
    return rows


def main() -> None:
    """Run both pairs on the same images, and write the results and plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=24, help="images per set, the first 3 for warm-up (a multiple of 3)")
    ap.add_argument("--turns", type=int, default=4, help="resend turns: each resends every image of the set once")
    ap.add_argument("--eric-core", type=int, default=0, help="CPU core Eric (all its processes) is pinned to")
    ap.add_argument("--sglang-core", type=int, default=1, help="CPU core for SGLang and this client")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.sched_setaffinity(0, {args.sglang_core})
    RESULTS.mkdir(exist_ok=True)
    model = ensure_checkpoint("qwen2_vl", "tiny")
    sets = image_sets(args.images)
    started = time.time()
    runs = {"no_alias": run_pair(model, False, sets, args), "alias": run_pair(model, True, sets, args)}
    rows = summarize(sets, runs)
    config = {
        "model": "qwen2_vl tiny through SGLang's protocol",
        "protocol": "SGLang 0.5.23 --language-only --encoder-urls, zmq_to_scheduler",
        "images_per_set": args.images - IMAGES_PER_REQUEST,
        "resend_turns": args.turns,
        "images_per_request": IMAGES_PER_REQUEST,
        "eric_core": args.eric_core,
        "sglang_core": args.sglang_core,
        "cpu": cpu_info(),
        "wall_s": time.time() - started,
    }
    results = {"config": config, "target_ratio": TARGET_RATIO, "table": rows, "runs": runs}
    (RESULTS / "eric_repeat_sglang.json").write_text(json.dumps(results, indent=2))
    plot(rows, RESULTS / "eric_repeat_sglang.png")
    logger.info(
        "Eric CPU ms per image through SGLang (first / resend, alias run; ratio; without the alias)\n%s",
        "\n".join(
            f"{r['set']:<10} {r['first_ms_alias_run']:8.2f} / {r['resend_ms_alias']:7.3f}  {r['ratio_alias']:6.1f}x "
            f"{'met' if r['target_met'] else 'NOT met'}; no alias {r['ratio_no_alias']:.2f}x; beyond idle "
            f"{r['first_net_ms_alias_run']:.2f} / {r['resend_net_ms_alias']:.3f} ms (no alias "
            f"{r['resend_net_ms_no_alias']:.3f}); idle {r['idle_cpu_s_per_s']:.3%} of a core, "
            f"{r['resend_wall_ms_per_image']:.0f} ms wall per resent image"
            for r in rows
        ),
    )


if __name__ == "__main__":
    main()
