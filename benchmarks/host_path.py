"""Eric's host side per core, in one run, against vLLM's own multimodal processor, transformers' processors (fast and
slow) and the floor: decoding alone with the same library (PIL for images, PyAV for videos).

Inputs: random_image (gradients plus noise) as JPEG and PNG at 224, 448 and 1024 px, and a 2 s 448 px MP4 at 30 fps
(4 frames sampled at 2 fps), --items distinct ones per set, served over loopback by `python -m http.server` on
--client-core. The model: tiny Qwen2-VL with the released Qwen2-VL processor limits (max_pixels 12845056, so 224 and
448 px keep their size and 1024 px is resized to 1036 px; videos up to 768 tokens a frame).
- decode: PIL's open + convert("RGB") + numpy (images), PyAV's decode of every frame to RGB (videos), in this process.
- hf_slow / hf_fast: decode, then transformers' image processor (backend "pil" / "torchvision"); videos: its video
  processor (torchvision only) on the 4 frames Eric samples.
- vllm: vLLM's MediaConnector fetching the URL over loopback, then vLLM's multimodal processor for the checkpoint
  (prompt tokenization and hashing included, its processor cache off), 4 frames a video.
- eric: a real Eric started on --eric-core, its engine and worker then moved to --client-core (the router has the
  core to itself), asked by /v1/encode for the URLs (3 images or 1 video a request, one at a time): its router
  process's on-CPU time (every thread's /proc/<pid>/task/*/schedstat) per item: fetch over loopback, decode,
  resize/normalize/patchify, hash, the hand-off to the engine, answering (the acks of its leases, sent after each
  answer, are outside the window). The engine and the tower are other processes, reported apart.
vLLM's processor returns uint8 pixel values (its model normalizes them on the device); Eric's and transformers' are
float32, normalized. The in-process candidates run one at a time on --eric-core (one torch thread), each over every
item --passes times; a figure is the median pass's CPU time per item (this process's, all threads). Targets
(issue): Eric >= 2x vLLM's items/s per core on every set, and Eric's ms per item within 1.3x of decode alone.
Writes benchmarks/results/host_path.{json,png}.
Usage: python benchmarks/host_path.py [--items 12] [--passes 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from eric_repeat import cpu_info

from eric_epd.checkpoints.builtin import ensure_checkpoint
from eric_epd.stack.process import free_port
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_bytes, random_image, video_bytes
from eric_epd.wire.handles import LEASE_HEADER

logger = logging.getLogger("host_path")
RESULTS = Path(__file__).parent / "results"
SETS = {
    "jpeg_224": ("JPEG", 224),
    "jpeg_448": ("JPEG", 448),
    "jpeg_1024": ("JPEG", 1024),
    "png_224": ("PNG", 224),
    "png_448": ("PNG", 448),
    "png_1024": ("PNG", 1024),
    "video_448": ("MP4", 448),
}
VIDEO_FRAMES, VIDEO_FPS, SAMPLED_FRAMES = 60, 30, 4
RELEASED_LIMITS = {"image": (3136, 12845056), "video": (128 * 28 * 28, 768 * 28 * 28)}
"""(min_pixels, max_pixels) of the released Qwen2-VL image processor and of transformers' Qwen2-VL video processor."""
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe."
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>Describe."
TARGET_VS_VLLM, TARGET_VS_DECODE = 2.0, 1.3


def checkpoint(root: Path) -> Path:
    """A copy of the tiny Qwen2-VL whose processor configs carry the released limits."""
    out = root / "qwen2_vl-released-limits"
    shutil.copytree(ensure_checkpoint("qwen2_vl", "tiny"), out)
    for name, modality in (("preprocessor_config.json", "image"), ("video_preprocessor_config.json", "video")):
        config = json.loads((out / name).read_text())
        lo, hi = RELEASED_LIMITS[modality]
        config.update(min_pixels=lo, max_pixels=hi, size={"shortest_edge": lo, "longest_edge": hi})
        (out / name).write_text(json.dumps(config, indent=2))
    return out


def media(n: int, root: Path) -> dict[str, list[str]]:
    """Per set, the file names of `n` distinct inputs written under `root` (seeds differ across sets)."""
    out: dict[str, list[str]] = {}
    for s, (name, (fmt, side)) in enumerate(SETS.items()):
        out[name] = []
        for i in range(n):
            seed = 1000 * s + i
            if fmt == "MP4":
                data, ext = video_bytes(VIDEO_FRAMES, side, side, fps=VIDEO_FPS, seed=seed), "mp4"
            else:
                data, ext = image_bytes(random_image(side, side, seed), fmt), fmt.lower()
            (root / f"{name}_{i}.{ext}").write_bytes(data)
            out[name].append(f"{name}_{i}.{ext}")
    return out


@contextlib.contextmanager
def origin(root: Path, core: int):
    """`python -m http.server` serving `root` on loopback, pinned to `core`; yields its base URL."""
    port = free_port()
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    cmd += ["--protocol", "HTTP/1.1"]  # keep-alive, as a real origin or CDN: a fetch is not a new connection
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(httpx.TransportError):
                httpx.get(base + "/", timeout=1)
                break
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def decode_floor(data: bytes, video: bool) -> np.ndarray:
    """Decoding alone: PIL to an RGB array, or PyAV's every frame to RGB."""
    if video:
        import av

        with av.open(io.BytesIO(data)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def sampled(frames: np.ndarray) -> np.ndarray:
    """The frames Eric samples from the 2 s video at 2 fps (vLLM's uniform sampling)."""
    return frames[np.linspace(0, len(frames) - 1, SAMPLED_FRAMES, dtype=int)]


def candidates(model: Path) -> dict:
    """Per in-process candidate, a function (set name, bytes, URL) -> anything, running the whole path."""
    from transformers import AutoImageProcessor, AutoVideoProcessor
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.media import MediaConnector

    slow = AutoImageProcessor.from_pretrained(model, backend="pil")
    fast = AutoImageProcessor.from_pretrained(model, backend="torchvision")
    video = AutoVideoProcessor.from_pretrained(model)
    config = ModelConfig(model=str(model), tokenizer=str(model), dtype="float32", mm_processor_cache_gb=0)
    vllm_processor = MULTIMODAL_REGISTRY.create_processor(config)
    connector = MediaConnector(media_io_kwargs={"video": {"num_frames": SAMPLED_FRAMES}})

    def vllm_path(name: str, data: bytes, url: str) -> object:
        if name.startswith("video"):
            clip = connector.fetch_video(url)
            mm = vllm_processor.info.parse_mm_data({"video": [getattr(clip, "media", clip)]})
            return vllm_processor(VIDEO_PROMPT, mm)
        return vllm_processor(IMAGE_PROMPT, vllm_processor.info.parse_mm_data({"image": [connector.fetch_image(url)]}))

    def hf(processor):
        def run(name: str, data: bytes, url: str) -> object:
            from PIL import Image

            if name.startswith("video"):
                return None if processor is slow else video(videos=[sampled(decode_floor(data, True))])
            return processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="np")

        return run

    return {
        "decode": lambda name, data, url: decode_floor(data, name.startswith("video")),
        "hf_slow": hf(slow),
        "hf_fast": hf(fast),
        "vllm": vllm_path,
    }


def in_process(model: Path, files: dict, root: Path, base: str, passes: int) -> dict:
    """Per candidate and set, CPU ms per item of this process (the median pass over every item; None where it does
    not apply)."""
    import torch

    torch.set_num_threads(1)
    out: dict[str, dict[str, float | None]] = {}
    for cand, run in candidates(model).items():
        out[cand] = {}
        for name, names in files.items():
            items = [((root / f).read_bytes(), f"{base}/{f}") for f in names]
            if run(name, *items[0]) is None:
                out[cand][name] = None
                continue
            times = []
            for _ in range(passes):
                start = time.process_time()  # CPU, not wall: a fetch's wait on the origin is no work of this core
                for data, url in items:
                    run(name, data, url)
                times.append((time.process_time() - start) * 1e3 / len(items))
            out[cand][name] = float(np.median(times))
            logger.info("%-8s %-10s %8.2f ms/item", cand, name, out[cand][name])
    return out


def proc_cpu_s(pid: int) -> float:
    """On-CPU seconds of process `pid`: /proc/<pid>/task/*/schedstat summed (ns; Eric's threads live as long as it)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


def group_pids(pgid: int) -> list[int]:
    """Every process of process group `pgid`."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError):
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry))
    return pids


def eric_router(model: Path, files: dict, base: str, cores: tuple[int, int], passes: int, log: Path) -> dict:
    """Per set, the router's (and apart, the engine's and workers') CPU ms per item, and request p50 ms."""
    out: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        core, tower_core = cores
        eric = stack.enter_context(EricServer(model, cpus=(core,), media_hosts=("127.0.0.1",), log_path=log))
        client = stack.enter_context(httpx.Client(timeout=300, headers=eric.headers))
        router = eric.proc.pid
        others = [p for p in group_pids(router) if p != router]
        for pid in others:  # the engine and the tower leave the router's core: it has the core to itself
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(task), {tower_core})

        def send(urls: list[str], modality: str) -> tuple[float, float, float]:
            """(request seconds, router and engine+workers CPU seconds) of one /v1/encode; its acks after."""
            body = {"items": [{"id": str(i), "modality": modality, "url": u} for i, u in enumerate(urls)]}
            r0, t0, start = proc_cpu_s(router), sum(map(proc_cpu_s, others)), time.perf_counter()
            resp = client.post(eric.url + "/v1/encode", json=body)
            took = time.perf_counter() - start
            cpu = (proc_cpu_s(router) - r0, sum(map(proc_cpu_s, others)) - t0)
            resp.raise_for_status()
            for item in resp.json()["items"]:
                handle = item["handle"]
                client.post(
                    f"{eric.url}/v1/embeddings/{item['hash']}/ack",
                    headers={LEASE_HEADER: handle["lease"]},
                    json={"instance_id": handle["instance_id"]},
                ).raise_for_status()
            return took, *cpu

        for name, names in files.items():
            modality, per = ("video", 1) if name.startswith("video") else ("image", 3)
            send([f"{base}/{names[0]}"], modality)  # warm-up (its hash is new: nothing else is that item)
            router_ms, tower_ms, latencies = [], [], []
            for p in range(passes):
                # each pass its own query string: other URLs and bytes fetched again (no alias hit), same pixels
                urls = [f"{base}/{f}?pass={p}" for f in names]
                sent = [send(urls[i : i + per], modality) for i in range(0, len(urls), per)]
                latencies += [took for took, _, _ in sent]
                router_ms.append(sum(r for _, r, _ in sent) * 1e3 / len(urls))
                tower_ms.append(sum(t for _, _, t in sent) * 1e3 / len(urls))
            out[name] = {
                "router_cpu_ms": float(np.median(router_ms)),
                "engine_and_workers_cpu_ms": float(np.median(tower_ms)),
                "request_p50_ms": float(np.median(latencies)) * 1e3,
            }
            logger.info("eric     %-10s %8.2f ms/item (router CPU)", name, out[name]["router_cpu_ms"])
    return out


def summarize(measured: dict, eric: dict, files: dict, root: Path) -> list[dict]:
    """One row per set: ms per item of each path, items/s per core, Eric's ratios and the targets' verdicts."""
    rows = []
    for name, names in files.items():
        ms = {c: measured[c][name] for c in measured} | {"eric": eric[name]["router_cpu_ms"]}
        row = {
            "set": name,
            "kib_per_item": sum((root / f).stat().st_size for f in names) / len(names) / 1024,
            "ms_per_item": ms,
            "items_per_s_per_core": {c: (1e3 / v if v else None) for c, v in ms.items()},
            "eric_speedup_vs_vllm": ms["vllm"] / ms["eric"],
            "eric_speedup_vs_hf_fast": ms["hf_fast"] / ms["eric"],
            "eric_over_decode": ms["eric"] / ms["decode"],
            "eric_engine_and_workers_cpu_ms": eric[name]["engine_and_workers_cpu_ms"],
            "eric_request_p50_ms": eric[name]["request_p50_ms"],
        }
        row["vs_vllm_met"] = row["eric_speedup_vs_vllm"] >= TARGET_VS_VLLM
        row["vs_decode_met"] = row["eric_over_decode"] <= TARGET_VS_DECODE
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars of items/s per core (log scale) per set, one bar per path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = ["decode", "eric", "vllm", "hf_fast", "hf_slow"]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    x, width = np.arange(len(rows)), 0.16
    for i, name in enumerate(paths):
        values = [r["items_per_s_per_core"][name] or 0 for r in rows]
        ax.bar(x + (i - 2) * width, values, width, label=name)
    for xi, r in zip(x, rows):
        ax.annotate(
            f"{r['eric_speedup_vs_vllm']:.2f}x vLLM\n{r['eric_over_decode']:.2f}x decode",
            (xi, r["items_per_s_per_core"]["decode"]),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(x, [f"{r['set']}\n{r['kib_per_item']:.0f} KiB" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("items/s on one core")
    ax.set_title("Host side per core: Eric's router vs vLLM's processor, transformers' and decoding alone")
    ax.legend(ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    """Measure every path on the same inputs and core; write the results and the plot."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=12, help="distinct inputs per set (a multiple of 3)")
    ap.add_argument("--passes", type=int, default=3, help="passes over every item; a figure is the median pass")
    ap.add_argument("--quick", action="store_true", help="a short run: 6 items, 2 passes")
    ap.add_argument("--eric-core", type=int, default=0, help="core for Eric (all its processes) and this process")
    ap.add_argument("--client-core", type=int, default=1, help="core for the loopback origin and Eric's client")
    args = ap.parse_args()
    if args.quick:
        args.items, args.passes = 6, 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    RESULTS.mkdir(exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp) / "media"
        root.mkdir()
        model, files = checkpoint(Path(tmp)), media(args.items, root)
        base = stack.enter_context(origin(root, args.client_core))
        os.sched_setaffinity(0, {args.eric_core})
        measured = in_process(model, files, root, base, args.passes)
        os.sched_setaffinity(0, {args.client_core})
        eric = eric_router(
            model, files, base, (args.eric_core, args.client_core), args.passes, RESULTS / "host_path_eric.log"
        )
        rows = summarize(measured, eric, files, root)
    results = {
        "config": {
            "model": "qwen2_vl tiny, released processor limits",
            "items_per_set": args.items,
            "passes": args.passes,
            "video": {"frames": VIDEO_FRAMES, "fps": VIDEO_FPS, "sampled_frames": SAMPLED_FRAMES},
            "eric_core": args.eric_core,
            "client_core": args.client_core,
            "cpu": cpu_info(),
            "wall_s": time.time() - started,
        },
        "targets": {"eric_speedup_vs_vllm": TARGET_VS_VLLM, "eric_over_decode": TARGET_VS_DECODE},
        "table": rows,
    }
    (RESULTS / "host_path.json").write_text(json.dumps(results, indent=2))
    plot(rows, RESULTS / "host_path.png")
    head = f"{'set':<10} {'KiB':>6} " + " ".join(f"{c:>8}" for c in ("decode", "eric", "vllm", "hf_fast", "hf_slow"))
    lines = [
        f"{r['set']:<10} {r['kib_per_item']:6.0f} "
        + " ".join(
            f"{(r['ms_per_item'][c] or float('nan')):8.2f}" for c in ("decode", "eric", "vllm", "hf_fast", "hf_slow")
        )
        + f"  {r['eric_speedup_vs_vllm']:5.2f}x vLLM {r['eric_over_decode']:5.2f}x decode"
        for r in rows
    ]
    logger.info("ms per item on one core\n%s\n%s", head, "\n".join(lines))


if __name__ == "__main__":
    main()
