"""Soak: the full local stack (2 Erics, a vLLM prefill/decode pair over NIXL, the gateway) under open-loop chat load
at a fraction of its measured capacity, while one component after another is killed and restarted, or stopped
past the engines' fetch and landing timeouts (a stalled Eric, a slow encode, a hung global-cache store master), or
held in a batch longer than every probe, or drained (soak_faults.py).

Reports requests accepted, answered correctly, failed with a clean error (an HTTP error in the JSON error shape, or a
refused connection while the gateway itself restarts), answered wrongly and lost (no answer within the client
timeout; must be 0); each process's RSS growth after warm-up; every Eric's pool bytes back to 0 at the end; and
whether the gateway ejected an Eric that was only busy (must not).
Writes benchmarks/results/soak.{json,png}.  Not run in CI.

Usage: python benchmarks/soak.py [--minutes 15] [--fault-every 180] [--load 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
from soak_faults import FAULTS, Stack, inject  # a sibling script (benchmarks/ is on sys.path)

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.process import ServerProcess, new_key
from eric_epd.stack.servers import EricServer, GatewayServer, StoreMaster, host_split, pd_vllm
from eric_epd.testing.media import image_data_url
from eric_epd.testing.stack import image_messages

logger = logging.getLogger("soak")
RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 300.0
EMBEDDING_TTL_S = 60
"""Eric's lease TTL here: embeddings leased for a request the killed gateway never forwarded wait this long."""


def prompts(n: int) -> list[list[dict]]:
    """A fixed set of chats: most with 2-3 images (EPD), some with one image or none (the plain P/D path)."""
    out = []
    for i in range(n):
        images = [image_data_url(64 + 8 * (i % 5), 72 + 8 * k, seed=5000 + 10 * i + k) for k in range(i % 4)]
        out.append(image_messages(images) if images else [{"role": "user", "content": f"Count to {i + 3}."}])
    return out


def start_stack(model: Path, logs: Path) -> Stack:
    """Start a global-cache store master, two Erics sharing it, a vLLM prefill/decode pair on the other core and
    the gateway in front."""
    eric_cpus = host_split()[0]
    eric_key, vllm_key = new_key(), new_key()
    store = StoreMaster(logs / "store.log").start()
    args = ("--embedding-ttl", str(EMBEDDING_TTL_S), "--global-cache", store.address)
    erics = [
        EricServer(model, log_path=logs / f"eric_{n}.log", api_key=eric_key, cpus=eric_cpus, extra_args=args).start()
        for n in "ab"
    ]
    urls = [e.url for e in erics]
    # the engines on the other core: a vLLM busy-polls for a second after every step, and an Eric sharing its core
    # starves (measured here with the prefill on the Erics' core: fetches timed out before any fault)
    engine_core = host_split()[1][0]
    prefill = pd_vllm(model, "kv_producer", engine_core, logs / "prefill.log", urls, eric_key, vllm_key).start()
    decode = pd_vllm(model, "kv_consumer", engine_core, logs / "decode.log", urls, eric_key, vllm_key).start()
    gateway = GatewayServer(
        logs / "gateway.log",
        "--encoder-urls",
        ",".join(urls),
        "--prefill-urls",
        prefill.url,
        "--decode-urls",
        decode.url,
        eric_api_key=eric_key,
        upstream_api_key=vllm_key,
    ).start()
    stack = Stack(erics, prefill, decode, gateway, store)
    stack.started = dict.fromkeys(stack.components(), time.monotonic())
    return stack


@dataclass
class Outcomes:
    """Requests by outcome, and when each ended (seconds since the start, outcome)."""

    counts: Counter = field(default_factory=Counter)
    timeline: list[tuple[float, str]] = field(default_factory=list)


async def one_request(
    client: openai.AsyncOpenAI, model: str, msgs: list[dict], expected: str, t0: float, out: Outcomes
) -> None:
    """Send one chat through the gateway and count how it ended: correct, wrong, lost or a clean or unshaped error."""
    out.counts["accepted"] += 1
    try:
        reply = await client.chat.completions.create(
            model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        kind = "correct" if reply.choices[0].message.content == expected else "wrong"
    except openai.APITimeoutError:
        kind = "lost"
    except openai.APIStatusError as e:
        shaped = isinstance(e.body, dict) and "message" in e.body
        kind = "clean_error" if shaped else "unshaped_error"
    except openai.APIConnectionError:
        kind = "clean_error"  # refused or reset at once: the gateway itself was down, the client knows at once
    out.counts[kind] += 1
    out.timeline.append((time.monotonic() - t0, kind))


async def closed_loop_rate(
    client: openai.AsyncOpenAI, model: str, chats: list, seconds: float, concurrency: int = 4
) -> float:
    """Requests/s the stack answers with `concurrency` clients back to back: its capacity."""
    done, deadline = 0, time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        i = k
        while time.monotonic() < deadline:
            await client.chat.completions.create(
                model=model,
                messages=chats[i % len(chats)],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            done, i = done + 1, i + concurrency

    start = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.monotonic() - start)


def rss_bytes(server: ServerProcess) -> int:
    """RSS of the server and every process it started."""
    if server.proc is None:
        return 0
    try:
        root = psutil.Process(server.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


async def soak(stack: Stack, args: argparse.Namespace) -> dict:
    """Measure capacity, then send open-loop load at `args.load` of it with a fault every `args.fault_every` s."""
    client = openai.AsyncOpenAI(
        base_url=stack.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    model = (await client.models.list()).data[0].id
    chats = prompts(16)
    expected = []
    for msgs in chats:  # the reference answers, from the stack before any fault
        reply = await client.chat.completions.create(
            model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        expected.append(reply.choices[0].message.content)
    capacity = await closed_loop_rate(client, model, chats, args.capacity_seconds)
    rate = args.load * capacity
    logger.info("capacity %.2f req/s; soaking at %.2f req/s for %.1f min", capacity, rate, args.minutes)

    out, faults, rss = Outcomes(), [], {name: [] for name in stack.components()}
    t0 = time.monotonic()
    end, next_fault, k = t0 + 60 * args.minutes, t0 + args.fault_every, 0
    tasks: set[asyncio.Task] = set()
    next_sample, rng = t0, random.Random(0)
    fault_task: asyncio.Task | None = None
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_sample:
            for name, server in stack.components().items():
                rss[name].append((now - t0, now - stack.started[name], rss_bytes(server)))
            next_sample = now + 5
        if fault_task is None and now >= next_fault:  # requests keep arriving while a component restarts
            fault = args.faults[len(faults) % len(args.faults)]
            fault_task = asyncio.create_task(asyncio.to_thread(inject, stack, fault))
            fault_started = now
        if fault_task is not None and fault_task.done():
            faults.append((fault_started - t0, time.monotonic() - t0, fault_task.result()))
            logger.info("%.0f s: %s (%.0f s)", fault_started - t0, faults[-1][2], faults[-1][1] - faults[-1][0])
            fault_task, next_fault = None, time.monotonic() + args.fault_every
        task = asyncio.create_task(one_request(client, model, chats[k % len(chats)], expected[k % len(chats)], t0, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        k += 1
        await asyncio.sleep(rng.expovariate(rate))
    if fault_task is not None:
        faults.append((fault_started - t0, time.monotonic() - t0, await fault_task))
    await asyncio.gather(*tasks)
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "minutes": args.minutes,
        "counts": dict(out.counts),
        "faults": faults,
        "timeline": out.timeline,
        "rss": rss,
        "busy_ejected": stack.ejected,
    }


def rss_growth(samples: list[tuple[float, float, int]], warmup_s: float) -> float | None:
    """RSS growth of the current process instance from its first sample after warm-up to its last."""
    instance = []
    for t, age, value in samples:
        if instance and age < instance[-1][1]:
            instance = []  # restarted
        instance.append((t, age, value))
    warm = [v for _, age, v in instance if age >= warmup_s and v > 0]
    return (warm[-1] / warm[0] - 1) if len(warm) >= 2 else None


def pool_bytes(stack: Stack, wait_s: float = EMBEDDING_TTL_S + 10) -> dict[str, int]:
    """Each Eric's pool bytes once idle (leases of requests a killed gateway never forwarded end at the TTL)."""
    deadline, used = time.monotonic() + wait_s, {}
    while True:
        used = {
            e.url: httpx.get(e.url + "/v1/transfer", headers=e.headers, timeout=10).json()["used_bytes"]
            for e in stack.erics
        }
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(1)


def plot(result: dict, path: Path) -> None:
    """Answers per second by outcome with the faults marked, and each server's RSS, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    width = 10.0
    for kind, color in (
        ("correct", "tab:green"),
        ("clean_error", "tab:orange"),
        ("wrong", "tab:red"),
        ("lost", "black"),
        ("unshaped_error", "tab:purple"),
    ):
        times = [t for t, k in result["timeline"] if k == kind]
        if times:
            bins = int(max(times) // width) + 1
            counts = Counter(int(t // width) for t in times)
            ax1.plot(
                [b * width for b in range(bins)], [counts[b] / width for b in range(bins)], label=kind, color=color
            )
    for start, _, what in result["faults"]:
        for ax in (ax1, ax2):
            ax.axvline(start, color="grey", ls="--", lw=0.8)
        ax1.text(start, ax1.get_ylim()[1] * 0.9, what.split(",")[0], rotation=90, fontsize=7, va="top")
    ax1.set_ylabel("answers/s (10 s bins)")
    ax1.legend(fontsize=8)
    for name, samples in result["rss"].items():
        ax2.plot([t for t, _, _ in samples], [v / 2**20 for _, _, v in samples], label=name)
    ax2.set_ylabel("RSS (MiB)")
    ax2.set_xlabel("seconds")
    ax2.legend(fontsize=8)
    fig.suptitle(f"soak at {result['rate_rps']:.2f} req/s ({result['counts']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Run the soak on a fresh stack, then write the results and plot and print the counts."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=15.0, help="how long the soak runs")
    ap.add_argument("--fault-every", type=float, default=180.0, help="seconds between faults")
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity")
    ap.add_argument(
        "--faults",
        type=lambda v: tuple(v.split(",")),
        default=FAULTS,
        help=f"comma-separated faults to cycle through (default: all, {','.join(FAULTS)})",
    )
    ap.add_argument("--capacity-seconds", type=float, default=45.0, help="seconds spent measuring capacity first")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds after a (re)start before RSS is counted")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the built-in tiny Qwen2-VL)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak", help="output path stem (.json and .png written)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logs = args.out.parent / "soak-logs"
    logs.mkdir(parents=True, exist_ok=True)
    stack = start_stack(args.model or ensure_checkpoint("qwen2_vl", "tiny"), logs)
    try:
        result = asyncio.run(soak(stack, args))
        result["pool_used_bytes_at_end"] = pool_bytes(stack)
    finally:
        stack.stop()
    result["rss_growth"] = {name: rss_growth(s, args.warmup) for name, s in result["rss"].items()}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    c = result["counts"]
    print(f"capacity {result['capacity_rps']:.2f} req/s, soaked at {result['rate_rps']:.2f} req/s")
    print(f"{'accepted':>10} {'correct':>8} {'clean err':>9} {'wrong':>6} {'lost':>5}")
    print(
        f"{c.get('accepted', 0):>10} {c.get('correct', 0):>8} {c.get('clean_error', 0):>9} {c.get('wrong', 0):>6} "
        f"{c.get('lost', 0):>5}"
    )
    for name, growth in result["rss_growth"].items():
        print(f"RSS growth {name:>8}: " + ("n/a" if growth is None else f"{100 * growth:+.1f}%"))
    print("pool bytes at the end:", result["pool_used_bytes_at_end"])
    print("busy Erics ejected:", result["busy_ejected"] or "none")


if __name__ == "__main__":
    main()
