"""The CUDA paths for anyone with a GPU: Eric equal to transformers on CUDA at TP 1 and 2, the worker's pinned
copies, SGLang's NIXL landing buffers registered as VRAM on each rank's own device, and the vLLM connector filling
vLLM's encoder cache on the device with the same tokens as vLLM's own encoder."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from eric_epd.eric.workload import EncodeSpec
from eric_epd.runtime.executor.device_io import DeviceIO
from eric_epd.runtime.executor.messages import ExecuteBatchMsg
from eric_epd.runtime.work import WorkItem, pack_spec
from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import image_data_url, random_image
from eric_epd.wire.handles import LEASE_HEADER
from tests.cuda.conftest import need_devices


@pytest.mark.parametrize("tp", [1, 2])
def test_eric_on_cuda_equals_transformers(qwen2_vl_tiny: Path, tmp_path: Path, tp: int) -> None:
    need_devices(tp)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    with EricServer(
        qwen2_vl_tiny, tp=tp, extra_args=("--device", "cuda", "--dtype", "float32"), log_path=tmp_path / "eric.log"
    ) as eric:
        health = httpx.get(eric.url + "/health", timeout=10).json()
        assert len(health["worker_pids"]) == tp
        resp = httpx.post(
            eric.url + "/v1/encode",
            headers=eric.headers,
            timeout=120,
            json={"items": [{"modality": "image", "url": image_data_url(120, 90, seed=7)}]},
        )
        assert resp.status_code == 200, resp.text
        item = resp.json()["items"][0]
        fetched = httpx.get(
            item["handle"]["http"], timeout=60, headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]}
        )
        assert fetched.status_code == 200, fetched.text
        ours = load_safetensors(fetched.content)["embedding"]
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    processor = AutoProcessor.from_pretrained(qwen2_vl_tiny)
    inputs = processor.image_processor(images=[random_image(120, 90, seed=7)], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(qwen2_vl_tiny, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = model.model.get_image_features(inputs["pixel_values"].cuda(), inputs["image_grid_thw"].cuda())
    torch.testing.assert_close(ours, ref.pooler_output[0].cpu(), rtol=1e-3, atol=1e-4)


def test_device_io_pinned_copies_and_pool_writes() -> None:
    """Pixels through alternating pinned staging buffers, cast on the device; rank 0's rows land in the registered
    pool."""
    pool = np.zeros(1 << 20, np.uint8)
    io = DeviceIO(torch.device("cuda:0"), pool)
    try:
        assert io._registered
        parts = [torch.randn(16 * 1176), torch.randn(32 * 1176)]
        pixels = io.inputs(parts, torch.bfloat16)
        assert pixels.device.type == "cuda" and pixels.dtype == torch.bfloat16
        assert io._staging[0] is not None and io._staging[0].is_pinned()
        torch.testing.assert_close(pixels.float().cpu(), torch.cat(parts).bfloat16().float())
        # three batches back to back through the two alternating buffers, none waiting for a sync in between
        more = [[torch.randn(8 * 1176) * k] for k in range(3)]
        staged = [io.inputs(p, torch.float32) for p in more]
        io.sync()
        for got, p in zip(staged, more):
            torch.testing.assert_close(got.cpu(), p[0])
        levels = io.inputs([torch.arange(256, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)], torch.bfloat16)
        assert levels.dtype == torch.uint8 and levels.cpu().tolist() == [*range(256), 0, 0, 0, 0]  # cast by the runner
        out = torch.randn(12, 64, device="cuda:0", dtype=torch.bfloat16)
        items = [
            WorkItem("a", "image", 16, 4096, 4 * 64 * 2, pack_spec(EncodeSpec("image", (1, 4, 4), 1176))),
            WorkItem("b", "image", 32, 0, 8 * 64 * 2, pack_spec(EncodeSpec("image", (1, 8, 4), 1176))),
        ]
        msg = ExecuteBatchMsg(1, "image", items)
        io.write(list(out.split([4, 8])), msg)
        host = out.cpu().view(torch.uint8).reshape(-1).numpy()
        assert bytes(pool[4096 : 4096 + 512]) == host[:512].tobytes()
        assert bytes(pool[:1024]) == host[512:].tobytes()
    finally:
        io.close()


def test_nixl_landing_buffers_register_vram_on_each_rank_device() -> None:
    """SGLang passes no gpu_id: each rank's current device is where its landing buffer is registered."""
    from eric_epd.plugins.sglang.plugin import NixlLandingEngine
    from eric_epd.wire.sglang import decode_nixl_session

    for device in range(torch.cuda.device_count()):
        torch.cuda.set_device(device)
        engine = NixlLandingEngine(f"rank{device}")
        buf = torch.empty(1 << 20, dtype=torch.uint8, device=f"cuda:{device}")
        try:
            engine.register(buf.data_ptr(), buf.numel())
            session = decode_nixl_session(engine.session_id)
            assert session is not None and (session.mem_type, session.device) == ("VRAM", device)
        finally:
            engine.close()


def test_connector_fills_vllm_encoder_cache_on_device(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    """vLLM on CUDA behind Eric: greedy tokens equal vLLM's own encoder's for one image, four, and a video."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import ECTransferConfig

    from eric_epd.testing.vllm_cases import (
        CASES,
        encode_case,
        epd_prompt,
        eric_key_in_env,
        greedy,
        llm_kwargs,
        raw_prompt,
    )

    cases = [c for c in CASES if c.name in ("one_image", "four_images", "one_video")]
    mono = LLM(**llm_kwargs(qwen2_vl_tiny))
    expected = {c.name: list(greedy(mono, raw_prompt(c)).outputs[0].token_ids) for c in cases}
    del mono
    torch.cuda.empty_cache()
    with EricServer(qwen2_vl_tiny, extra_args=("--device", "cuda"), log_path=tmp_path / "eric.log") as eric:
        ec = ECTransferConfig(
            ec_connector="EricECConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cuda",
            ec_connector_extra_config={"eric_urls": [eric.url], "backends": ["shm", "nixl", "http"]},
        )
        with eric_key_in_env(eric.api_key):
            llm = LLM(**llm_kwargs(qwen2_vl_tiny), ec_transfer_config=ec)
        for case in cases:
            items = encode_case(eric.url, case, eric.api_key)
            out = greedy(llm, epd_prompt(case, items), items)
            assert list(out.outputs[0].token_ids) == expected[case.name], case.name


@pytest.mark.parametrize("backend", ["shm", "nixl", "http"])
def test_landing_area_on_the_device(backend: str) -> None:
    """A worker's landing area in GPU memory: NIXL READs into it (registered once as VRAM), shm copies host to
    device on the area's own stream, HTTP bounces through pinned memory; every byte arrives."""
    import uuid

    from eric_epd.plugins.vllm.landing import LandingAddress, LandingArea, LandingChannel
    from eric_epd.testing.pool_server import seeded_bytes
    from eric_epd.testing.server import PoolServer
    from eric_epd.transfer.client import EmbeddingFetcher, as_handle

    address = LandingAddress(f"cuda{uuid.uuid4().hex[:8]}")
    with PoolServer(backends="shm,nixl", pool_bytes=16 << 20) as producer:
        area = LandingArea(address, 0, 8 << 20, torch.device("cuda", 0), EmbeddingFetcher((backend,)), 2, torch.float16)
        channel = LandingChannel(address, 1)
        try:
            h = as_handle(
                httpx.post(
                    producer.url + "/v1/testing/entries", timeout=60, json={"hash": "dev", "nbytes": 3 << 20, "seed": 4}
                ).json()
            )
            assert channel.land(4096, h, 60) == backend
            got = area.tensor(4096, (h.nbytes,), "uint8", torch.uint8)
            assert got.is_cuda and np.array_equal(got.cpu().numpy(), seeded_bytes(h.nbytes, 4))
            copy = area.take(4096, h.hash)  # copied out on the landing stream before the notice
            assert copy is not None and copy.is_cuda and copy.dtype == torch.float16
            assert torch.equal(copy, got.to(torch.float16))
        finally:
            channel.close()
            area.close()


def test_varlen_attention_kernel_equals_grouped_sdpa() -> None:
    """The CUDA varlen kernel (flash-attn or torch's) gives what length-grouped SDPA in float32 gives."""
    from eric_epd.models.layers.attention import VarlenPlan, cuda_varlen_kernel, varlen_attention

    assert cuda_varlen_kernel() in ("flash_attn", "torch")
    cu = [0, 64, 100, 356, 420]
    plan = VarlenPlan.build(cu, torch.device("cuda"))
    q, k, v = (torch.randn(420, 8, 64, device="cuda") for _ in range(3))
    ref = varlen_attention(q, k, v, plan)  # float32: the grouped SDPA path
    got = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
