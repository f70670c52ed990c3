"""Shared prompts and media for the vLLM tests and benchmark: the same images and videos go to monolithic vLLM
(raw media) and to vLLM behind Eric (metadata + uuid), so their greedy tokens can be compared.

`python -m eric_epd.testing.vllm_cases MODEL OUT.json [CASE ...]` runs monolithic vLLM on the cases (default all)
and writes its tokens and margins (Greedy.to_json()).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eric_epd.testing.exactness import Greedy, greedy_of_vllm
from eric_epd.testing.media import image_bytes, random_image, video_bytes

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
MAX_TOKENS = 12


@dataclass(frozen=True)
class Case:
    """One prompt's media: random images of the given sizes and an optional video, seeded."""

    name: str
    image_sizes: tuple[tuple[int, int], ...] = ()
    video_frames: int = 0
    seed: int = 0

    def images(self) -> list[bytes]:
        """The case's images as PNG bytes."""
        return [image_bytes(random_image(w, h, seed=self.seed * 100 + i)) for i, (w, h) in enumerate(self.image_sizes)]

    def videos(self) -> list[bytes]:
        """The case's video as MP4 bytes, if it has one."""
        return [video_bytes(self.video_frames, 84, 56, fps=4, seed=self.seed)] if self.video_frames else []

    def prompt(self) -> str:
        """The Qwen chat prompt with one placeholder per image and video."""
        parts = "<|vision_start|><|image_pad|><|vision_end|>" * len(self.image_sizes)
        parts += "<|vision_start|><|video_pad|><|vision_end|>" * (1 if self.video_frames else 0)
        return f"{SYSTEM}<|im_start|>user\n{parts}Describe what you see.<|im_end|>\n<|im_start|>assistant\n"


CASES = (
    Case("one_image", ((96, 72),), seed=1),
    Case("two_images", ((64, 64), (150, 100)), seed=2),
    Case("four_images", ((56, 84), (112, 112), (200, 150), (90, 60)), seed=3),
    Case("one_video", video_frames=8, seed=4),
)


def decoded_video(data: bytes) -> np.ndarray:
    """The frames Eric samples from a video (so monolithic vLLM sees exactly the same pixels)."""
    from eric_epd.eric.decode import decode_video
    from eric_epd.media.limits import MediaLimits

    return decode_video(data, MediaLimits())[0]


def decoded_video_with_metadata(data: bytes, model: Path | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Eric's frames (sampled as `model`'s processor samples them) with the metadata vLLM's processor needs: the
    sampled fps for Qwen2.5-VL's time spacing; each frame's source time for Qwen3-VL's timestamps (as frame
    numbers at 1000 fps)."""
    from eric_epd.eric.decode import decode_video
    from eric_epd.media.limits import MediaLimits
    from eric_epd.models.registry import load_processor

    sampler = load_processor(model).frame_indices if model is not None else None
    frames, sampled_fps, seconds = decode_video(data, MediaLimits(), sampler)
    n = len(frames)
    if model is not None and sampler is not None and sampler(2, 1.0) is not None:
        return frames, {
            "fps": 1000.0,
            "duration": seconds[-1],
            "total_num_frames": round(seconds[-1] * 1000) + 1,
            "frames_indices": [round(s * 1000) for s in seconds],
            "video_backend": "eric",
            "do_sample_frames": False,
        }
    return frames, {
        "fps": sampled_fps,
        "duration": n / sampled_fps,
        "total_num_frames": n,
        "frames_indices": list(range(n)),
        "video_backend": "eric",
        "do_sample_frames": False,
    }


def raw_prompt(case: Case, video_metadata: bool = False, model: Path | None = None) -> dict[str, Any]:
    """The monolithic request: raw pixels, decoded exactly as Eric decodes them (videos with their metadata for
    models that need it, like Qwen2.5-VL; sampled as `model`'s processor samples, like Qwen3-VL)."""
    import io

    from PIL import Image

    mm: dict[str, Any] = {}
    if case.image_sizes:
        mm["image"] = [Image.open(io.BytesIO(b)).convert("RGB") for b in case.images()]
    if case.video_frames:
        if video_metadata or model is not None:
            mm["video"] = [decoded_video_with_metadata(v, model) for v in case.videos()]
        else:
            mm["video"] = [decoded_video(v) for v in case.videos()]
    return {"prompt": case.prompt(), "multi_modal_data": mm}


def epd_prompt(case: Case, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The EPD request: grids and Eric content hashes only, no pixels."""
    import torch

    mm: dict[str, Any] = {}
    uuids: dict[str, list[str]] = {}
    for modality in ("image", "video"):
        mine = [i for i in items if i["modality"] == modality]
        if mine:
            mm[modality] = {f"{modality}_grid_thw": torch.tensor([i["grid_thw"] for i in mine])}
            if all("timestamps" in i for i in mine):  # Qwen3-VL videos: the prompt states each step's time
                mm[modality]["timestamps"] = [i["timestamps"] for i in mine]
            uuids[modality] = [i["hash"] for i in mine]
    return {"prompt": case.prompt(), "multi_modal_data": mm, "multi_modal_uuids": uuids}


def encode_case(eric_url: str, case: Case, api_key: str | None = None) -> list[dict[str, Any]]:
    """POST the case's media to an Eric; its answer items (hash, grid_thw, handle with its lease token...)."""
    import httpx

    from eric_epd.common.http import bearer
    from eric_epd.testing.media import data_url

    items = [{"modality": "image", "url": data_url(b)} for b in case.images()]
    items += [{"modality": "video", "url": data_url(v, "video/mp4")} for v in case.videos()]
    resp = httpx.post(eric_url + "/v1/encode", json={"items": items}, timeout=120, headers=bearer(api_key))
    resp.raise_for_status()
    return resp.json()["items"]


def greedy(llm: Any, prompt: dict[str, Any], items: list[dict[str, Any]] | None = None) -> Any:
    """One greedy generation of MAX_TOKENS tokens (EOS ignored, so every run has the same length) with each step's
    two best logprobs; `items` (Eric's answer) hands their handles to the connector beside the request, as the
    gateway does."""
    from vllm import SamplingParams

    from eric_epd.wire.handoff import handles_xargs

    extra = handles_xargs(i["handle"] for i in {i["hash"]: i for i in items}.values()) if items else None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra, logprobs=2)
    return llm.generate(prompt, params)[0]


def greedy_run(llm: Any, prompt: dict[str, Any], items: list[dict[str, Any]] | None = None) -> Greedy:
    """greedy()'s tokens and margins, to compare with assert_greedy_agree."""
    return greedy_of_vllm(greedy(llm, prompt, items).outputs[0])


@contextlib.contextmanager
def eric_key_in_env(api_key: str | None, ranks: int = 1) -> Iterator[None]:
    """While an offline LLM starts: ERIC_API_KEY set (its engine processes inherit it; the connector reads it), and
    this process on the engine's half of the CPUs with vLLM's OpenMP threads bound there, so the engine processes
    it spawns never share Eric's cores (as `eric-epd up` and VllmServe place them). With `ranks` tensor-parallel
    ranks each gets its own share (of the whole host's CPUs when the engine's half has too few)."""
    from eric_epd.common.cpus import format_cpus
    from eric_epd.stack.servers import host_split

    engine_cpus = host_split()[1]
    saved = {k: os.environ.get(k) for k in ("ERIC_API_KEY", "VLLM_CPU_OMP_THREADS_BIND")}
    affinity = os.sched_getaffinity(0)
    if len(engine_cpus) < ranks:
        engine_cpus = tuple(sorted(affinity))
    share = max(1, len(engine_cpus) // ranks)
    os.environ["ERIC_API_KEY"] = api_key or ""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        format_cpus(engine_cpus[r * share : (r + 1) * share]) for r in range(ranks)
    )
    os.sched_setaffinity(0, engine_cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def yielding_new_children() -> Iterator[None]:
    """Every thread of the processes this one starts inside the block (an in-process vLLM's engine core and workers)
    runs under SCHED_IDLE, and threads they start later inherit it: where vLLM's workers must share cores with an
    Eric (vLLM at TP 2 on a 2-core host), a runnable Eric thread always gets the CPU first.

    Lowering their nice value is not enough: a vLLM worker waiting for its next step spins on sched_yield(), and
    such a spinner at nice 10 kept the Eric's runnable event loop and NIXL progress thread off its core for tens of
    seconds here (both in state R, neither answering; kernel 6.18)."""
    import psutil

    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    for child in me.children(recursive=True):
        if child.pid in before:
            continue
        with contextlib.suppress(psutil.Error):
            for thread in child.threads():
                with contextlib.suppress(ProcessLookupError):  # a thread that ended since it was listed
                    os.sched_setscheduler(thread.id, os.SCHED_IDLE, os.sched_param(0))


def llm_kwargs(model: Path) -> dict[str, Any]:
    """The `LLM` arguments every vLLM test uses: float32, eager, seeded, small KV cache."""
    return dict(
        model=str(model),
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.15,
        limit_mm_per_prompt={"image": 4, "video": 1},
    )


def main() -> None:
    """Run monolithic vLLM on the named cases (default all) and write their greedy tokens as JSON."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    cases = [c for c in CASES if not names or c.name in names]
    llm = LLM(**llm_kwargs(model))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate([raw_prompt(c) for c in cases], params)
    out.write_text(json.dumps({c.name: greedy_of_vllm(o.outputs[0]).to_json() for c, o in zip(cases, outputs)}))


if __name__ == "__main__":
    main()
