"""The SGLang prefill harness shared by the SGLang tests: module-scoped fixtures that start three Erics and the
prefill host (and transformers' references), the media they use, and the checks of what SGLang's receivers hold."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from eric_epd.stack.process import free_port, stop_all
from eric_epd.stack.servers import EricServer, StoreMaster
from eric_epd.testing.media import random_image
from eric_epd.testing.sglang_prefill import Bootstrap, Outcome, Prefill, unpack
from tests.support.helpers_servers import start_in_threads
from tests.support.sglang_probes import ELSEWHERE

RTOL, ATOL = 1e-4, 1e-5  # float32, as tests/eric/test_server.py: Eric's batched varlen attention vs HF per image
IMAGES = [(64, 48, 1), (40, 90, 2), (112, 84, 3)]  # (width, height, seed); different sizes catch misplaced rows
SPLIT_IMAGES = [(56, 56, 11), (84, 28, 12), (28, 112, 13), (70, 98, 14)]
STORED_IMAGES = [(60, 44, 21), (44, 76, 22)]
IMAGE_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_TAG = "<|vision_start|><|video_pad|><|vision_end|>"


def prompt_for(num_images: int, num_videos: int = 0) -> str:
    return "Describe " + " and ".join([IMAGE_TAG] * num_images + [VIDEO_TAG] * num_videos) + " please."


# ------------------------------------------------------------------------------------------------ fixtures


def plugin_entry_point(tmp: Path) -> Path:
    """A directory whose dist-info declares eric_epd's `sglang.srt.plugins` entry point (what installing eric-epd
    next to SGLang declares); the prefill host puts it on sys.path."""
    dist = tmp / "entry" / "eric_epd_sglang_entry_point-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eric-epd-sglang-entry-point\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\neric_epd = eric_epd.plugins.sglang.plugin:register\n")
    return tmp / "entry"


@pytest.fixture(scope="module")
def bootstrap_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def setup(qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path, bootstrap_port: int, tmp_path_factory: pytest.TempPathFactory):
    """Three Erics (booting while the prefill host imports SGLang) and the prefill host; A and C share a global
    cache (a Mooncake Store master started by the project's launcher).

    A: Qwen2-VL, parts sent as float16 (SGLang's --dtype auto for these float32 checkpoints; Eric converts).
    B: Qwen2.5-VL, --sglang-dtype float32 for prefills run with --dtype float32 (no conversion); it may also push
       to 127.0.0.2 (--sglang-allowed-peer), A and C only to their callers (127.0.0.1). A and B take NIXL sessions
       from 127.0.0.1 only (allowlisted); C, with no allowlist, from nobody.
    C: Qwen2-VL like A, and it registers itself with the prefill's EncoderBootstrapServer.
    """
    tmp = tmp_path_factory.mktemp("sglang")
    backends = ("--transfer-backends", "shm")
    master = StoreMaster(tmp / "master.log").start()
    shared = ("--global-cache", master.address, "--global-cache-bytes", str(64 << 20))
    erics = {  # A also runs Eric's own Mooncake and NIXL producers, beside the adapter's push engines
        "A": EricServer(
            qwen2_vl_tiny,
            log_path=tmp / "A.log",
            extra_args=("--transfer-backends", "shm,mooncake,nixl", "--sglang-allowed-peer", "127.0.0.1/32", *shared),
        ),
        "B": EricServer(
            qwen2_5_vl_tiny,
            log_path=tmp / "B.log",
            extra_args=(
                *backends,
                "--sglang-dtype",
                "float32",
                "--sglang-allowed-peer",
                f"{ELSEWHERE}/32",
                "--sglang-allowed-peer",
                "127.0.0.1/32",
            ),
        ),
        "C": EricServer(
            qwen2_vl_tiny,
            log_path=tmp / "C.log",  # retries every 5 s, 30 times
            extra_args=(*backends, "--sglang-register-url", f"http://127.0.0.1:{bootstrap_port}", *shared),
        ),
    }
    join = start_in_threads(erics.values())
    prefill = Prefill(plugin_entry_point(tmp))
    try:
        prefill.wait_ready()
        prefill.call(Bootstrap(bootstrap_port))
        join()
        yield prefill, erics
    finally:
        prefill.stop()
        for eric in erics.values():
            if eric.proc is not None and eric.proc.poll() is None:
                os.kill(eric.proc.pid, signal.SIGCONT)
        stop_all(*erics.values(), hurry=True)  # no test here drains
        master.stop()


@contextmanager
def prefill_beside_eric(model: Path, tmp: Path) -> Iterator[tuple[Prefill, EricServer]]:
    """The prefill host and one Eric on `model` (float32 rows, shm transfers, NIXL sessions from 127.0.0.1), the Eric
    booting while the host imports SGLang; both stopped on exit."""
    eric = EricServer(
        model,
        log_path=tmp / "eric.log",
        extra_args=(
            "--dtype",
            "float32",
            "--sglang-dtype",
            "float32",
            "--transfer-backends",
            "shm",
            "--sglang-allowed-peer",
            "127.0.0.1/32",
        ),
    )
    join = start_in_threads([eric])
    prefill = Prefill(plugin_entry_point(tmp))
    try:
        prefill.wait_ready()
        join()
        yield prefill, eric
    finally:
        prefill.stop()
        eric.stop()


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> dict[str, dict[str, Any]]:
    """transformers' get_image_features and image_grid_thw, per checkpoint, for IMAGES and SPLIT_IMAGES."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out: dict[str, dict[str, Any]] = {}
    for family, ckpt in (("qwen2_vl", qwen2_vl_tiny), ("qwen2_5_vl", qwen2_5_vl_tiny)):
        processor = AutoProcessor.from_pretrained(ckpt)
        model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        for name, specs in (("images", IMAGES), ("split", SPLIT_IMAGES)):
            inputs = processor.image_processor(images=[random_image(w, h, s) for w, h, s in specs], return_tensors="pt")
            with torch.no_grad():
                feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            out.setdefault(family, {})[name] = (list(feats.pooler_output), inputs["image_grid_thw"].tolist())
    return out


def eric_tensors(eric: EricServer, urls: list[str], modality: str = "image") -> list[tuple[torch.Tensor, list[int]]]:
    """Eric's own tensors for these media: native /v1/encode, then the transfer client (HTTP), then ack."""
    from eric_epd.transfer.client import EmbeddingFetcher

    resp = httpx.post(
        eric.url + "/v1/encode",
        json={"items": [{"modality": modality, "url": u} for u in urls]},
        headers=eric.headers,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    fetcher = EmbeddingFetcher(["http"], api_key=eric.api_key)
    try:
        return [(fetcher.fetch(item["handle"]), item["grid_thw"]) for item in resp.json()["items"]]
    finally:
        fetcher.close()


def check_equal(
    outcome: Outcome,
    eric: list[tuple[torch.Tensor, list[int]]],
    hf: tuple[list[torch.Tensor], list] | None,
    dtype: torch.dtype,
    modality: str = "IMAGE",
) -> None:
    """The receiver's rows are Eric's (within one rounding step: a re-encode may batch differently), in the
    prefill's dtype (a float32 -> float16 cast is Eric's
    Tensor.to), and transformers' within float32 (RTOL/ATOL) or float16 rounding (1e-3) tolerance."""
    assert outcome.ok, f"rank {outcome.rank}: {outcome.error_code} {outcome.error_msg}"
    got = [unpack(t) for t, m in zip(outcome.embeddings, outcome.modalities) if m == modality]
    assert len(got) == len(eric)
    for i, (mine, (ours, _grid)) in enumerate(zip(got, eric)):
        assert mine.dtype == dtype
        # `ours` is a second encode of the same content; its batch may differ, and batched matmuls are not
        # bit-stable across batch shapes, so compare within one rounding step of the prefill's dtype
        close = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
        torch.testing.assert_close(
            mine.float(),
            ours.to(dtype).float(),
            **close,
            msg=lambda m, i=i: f"item {i}: SGLang's receiver holds other rows than Eric: {m}",
        )
        if hf is not None:
            tol = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
            torch.testing.assert_close(mine.float(), hf[0][i], **tol, msg=lambda m, i=i: f"item {i}: {m}")
    key = "img_grid_thw" if modality == "IMAGE" else "video_grid_thw"
    assert outcome.grid[key] == [g for _, g in eric]
    if hf is not None:
        assert outcome.grid[key] == hf[1]


def items_counter(eric: EricServer) -> float:
    text = httpx.get(eric.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^eric_items_total\{[^}]*modality="image"[^}]*\} (\S+)$', text, re.M))
