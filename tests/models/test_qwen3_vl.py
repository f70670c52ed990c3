"""Qwen3-VL behind Eric: its processor and its tower equal transformers' (the merged tokens and every DeepStack
level, TP 1 in-process and TP 2 served), and in real vLLM the EPD tokens equal vLLM's own encoder's, while a
perturbed DeepStack level changes them (vLLM really consumes the levels Eric sends). Qwen3-VL-MoE in vLLM behind
Eric is proven through the gateway (tests/gateway/test_gateway_qwen3.py), one vLLM start per family."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file

from eric_epd.common.widths import embedding_width
from eric_epd.models.registry import load_encoder, load_processor, read_model_config
from eric_epd.stack.process import new_key, running
from eric_epd.stack.servers import EricServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.media import image_bytes, random_image
from eric_epd.testing.vllm_cases import (
    CASES,
    Case,
    encode_case,
    epd_prompt,
    eric_key_in_env,
    greedy,
    greedy_run,
    llm_kwargs,
    raw_prompt,
)
from eric_epd.wire.handles import LEASE_HEADER

SIZES = [(120, 90), (33, 200), (224, 224), (57, 57)]  # odd sizes: resize, padding to the 32-px factor


def _images() -> list[Image.Image]:
    return [
        Image.open(io.BytesIO(image_bytes(random_image(w, h, seed=50 + i)))).convert("RGB")
        for i, (w, h) in enumerate(SIZES)
    ]


@pytest.fixture(scope="module")
def hf(qwen3_vl_tiny: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen3_vl_tiny).image_processor
    model = AutoModelForImageTextToText.from_pretrained(qwen3_vl_tiny, dtype=torch.float32).eval()
    return processor, model


def _hf_rows(hf, image: Image.Image) -> tuple[torch.Tensor, list[int]]:
    """transformers' rows for one image: [merged | level 1 | level 2] on the last dimension, and its grid."""
    processor, model = hf
    inputs = processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    rows = torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1)
    return rows, inputs["image_grid_thw"][0].tolist()


def test_processor_equals_hf(qwen3_vl_tiny: Path, hf) -> None:
    ours = load_processor(qwen3_vl_tiny)
    assert ours.modalities == ("image", "video")
    for image in _images():
        ref = hf[0](images=[image], return_tensors="np")
        item = ours.process_image(image)
        assert list(item.grid_thw) == ref["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(item.float_pixels(), ref["pixel_values"])


def test_tower_equals_hf_every_level(qwen3_vl_tiny: Path, hf) -> None:
    """One batch of four images of odd sizes through Eric's encoder (TP 1): each image's merged tokens and each
    DeepStack level equal transformers'."""
    cfg = read_model_config(qwen3_vl_tiny)
    width, levels = cfg["vision_config"]["out_hidden_size"], len(cfg["vision_config"]["deepstack_visual_indexes"])
    assert levels == 2 and embedding_width(cfg) == width * 3
    processor, encoder = load_processor(qwen3_vl_tiny), load_encoder(qwen3_vl_tiny, torch.float32, "cpu")
    items = [processor.process_image(image) for image in _images()]
    out = encoder(
        torch.from_numpy(np.concatenate([i.float_pixels() for i in items])),
        torch.tensor([list(i.grid_thw) for i in items]),
    )
    assert out.shape == (sum(i.num_tokens for i in items), width * 3)
    for rows, image in zip(out.split([i.num_tokens for i in items]), _images()):
        ref, _ = _hf_rows(hf, image)
        for level in range(1 + levels):
            part = slice(level * width, (level + 1) * width)
            torch.testing.assert_close(rows[:, part], ref[:, part], rtol=1e-4, atol=1e-5, msg=f"level {level}")


@pytest.fixture(scope="module")
def erics(qwen3_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """A TP-2 Eric on the checkpoint, and a TP-1 Eric on a copy whose first DeepStack merger is perturbed."""
    tmp = tmp_path_factory.mktemp("qwen3")
    perturbed = tmp / "perturbed"
    shutil.copytree(qwen3_vl_tiny, perturbed)
    weights = load_file(perturbed / "model.safetensors")
    [key] = [k for k in weights if k.endswith("deepstack_merger_list.0.linear_fc2.weight")]
    weights[key] = -4.0 * weights[key]
    save_file(weights, perturbed / "model.safetensors", metadata={"format": "pt"})
    key_ = new_key()
    main = EricServer(qwen3_vl_tiny, tp=2, log_path=tmp / "main.log", api_key=key_)
    other = EricServer(perturbed, log_path=tmp / "perturbed.log", api_key=key_)
    with running(main, other, hurry=True):  # no test here drains
        yield main, other


def test_eric_tp2_equals_hf(erics, hf) -> None:
    main, _ = erics
    images = _images()
    body = {"items": [{"modality": "image", "url": "data:image/png;base64," + _b64(img)} for img in images]}
    resp = httpx.post(main.url + "/v1/encode", json=body, headers=main.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    for item, image in zip(resp.json()["items"], images):
        ref, grid = _hf_rows(hf, image)
        assert item["grid_thw"] == grid and item["shape"] == list(ref.shape)
        fetched = httpx.get(item["handle"]["http"], headers=main.headers | {LEASE_HEADER: item["handle"]["lease"]})
        assert fetched.status_code == 200
        torch.testing.assert_close(load_safetensors(fetched.content)["embedding"], ref, rtol=1e-4, atol=1e-5)


def test_eric_tp2_video_equals_hf(erics, hf, qwen3_vl_tiny: Path) -> None:
    """A video (odd frame count after sampling, odd size) through the TP-2 Eric: every DeepStack level equals
    transformers' on the frames Qwen3VLVideoProcessor samples from the same file."""
    from transformers import AutoVideoProcessor

    from eric_epd.eric.decode import decode_video
    from eric_epd.media.limits import MediaLimits
    from eric_epd.testing.media import data_url, video_bytes

    data = video_bytes(num_frames=11, width=88, height=56, fps=4, seed=7)
    resp = httpx.post(
        main_url := erics[0].url + "/v1/encode",
        headers=erics[0].headers,
        timeout=120,
        json={"items": [{"modality": "video", "url": data_url(data, "video/mp4")}]},
    )
    assert resp.status_code == 200, (main_url, resp.text)
    item = resp.json()["items"][0]
    frames, _, seconds = decode_video(data, MediaLimits(), load_processor(qwen3_vl_tiny).frame_indices)
    assert seconds == (0.0, 0.5, 1.25, 2.0, 2.5)  # frames 0, 2, 5, 8 and 10 of 11 at 4 fps
    assert item["timestamps"] == [0.25, 1.625, 2.5]  # the last frame repeated to fill the final temporal step
    inputs = AutoVideoProcessor.from_pretrained(qwen3_vl_tiny)(
        videos=[frames], do_sample_frames=False, return_tensors="pt"
    )
    with torch.no_grad():
        out = hf[1].model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    ref = torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1)
    assert item["grid_thw"] == inputs["video_grid_thw"][0].tolist()
    fetched = httpx.get(item["handle"]["http"], headers=erics[0].headers | {LEASE_HEADER: item["handle"]["lease"]})
    torch.testing.assert_close(load_safetensors(fetched.content)["embedding"], ref, rtol=1e-4, atol=1e-5)


def test_bad_input_particular_to_qwen3_vl(erics, hf, tmp_path: Path) -> None:
    """A video needing more frames than the budget and an image whose aspect ratio the processor refuses get a 4xx
    naming the problem, a 1x1 image is scaled up as transformers scales it, and a checkpoint of an unregistered
    family stops Eric at start with a message naming it."""
    import subprocess
    import sys

    from eric_epd.testing.media import data_url, video_bytes

    main, _ = erics

    def encode(modality: str, url: str) -> httpx.Response:
        return httpx.post(
            main.url + "/v1/encode",
            headers=main.headers,
            timeout=120,
            json={"items": [{"modality": modality, "url": url}]},
        )

    long_video = encode("video", data_url(video_bytes(num_frames=160, width=32, height=32, fps=4), "video/mp4"))
    assert long_video.status_code == 413, long_video.text
    assert "80 frames" in long_video.json()["error"]["message"]  # 40 s at the processor's 2 fps, over 64
    flat = encode("image", "data:image/png;base64," + _b64(Image.new("RGB", (600, 2))))
    assert flat.status_code == 400 and "aspect ratio" in flat.json()["error"]["message"], flat.text
    dot = encode("image", "data:image/png;base64," + _b64(Image.new("RGB", (1, 1))))
    hf_grid = hf[0](images=[Image.new("RGB", (1, 1))], return_tensors="np")["image_grid_thw"][0].tolist()
    assert dot.status_code == 200 and dot.json()["items"][0]["grid_thw"] == hf_grid, dot.text
    assert httpx.get(main.url + "/health").status_code == 200
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llava", "vision_config": {}}')
    run = subprocess.run(
        [sys.executable, "-m", "eric_epd", "serve", "--model", str(other), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "unsupported model_type 'llava'" in run.stderr + run.stdout


def _b64(image: Image.Image) -> str:
    import base64

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_vllm_epd_tokens_equal_monolithic_and_levels_are_consumed(qwen3_vl_tiny: Path, erics) -> None:
    """vLLM behind Eric: one image, four images and a video (its timestamps in the prompt) give vLLM's own encoder's
    greedy tokens (up to the first near tie), and the four images' EPD answer fails the same comparison with vLLM's
    answer for four other images of the same sizes (the negative control); the same engine fed a perturbed first
    DeepStack level (the merged tokens and the second level unchanged) answers differently."""
    from vllm import LLM
    from vllm.config import ECTransferConfig

    main, other = erics
    with eric_key_in_env(main.api_key):
        ec = ECTransferConfig(
            ec_connector="EricECConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_connector_extra_config={"eric_urls": [main.url, other.url], "backends": ["shm"]},
        )
        llm = LLM(**llm_kwargs(qwen3_vl_tiny), ec_transfer_config=ec, disable_log_stats=False)
        cases = {c.name: c for c in CASES}
        epd = {}
        for name in ("one_image", "four_images", "one_video"):
            monolithic = greedy_run(llm, raw_prompt(cases[name], model=qwen3_vl_tiny))
            items = encode_case(main.url, cases[name], main.api_key)
            epd[name] = greedy_run(llm, epd_prompt(cases[name], items), items)
            assert_greedy_agree(epd[name], monolithic, NEAR_TIE_FLOAT32, name)
        others = Case("four_other_images", cases["four_images"].image_sizes, seed=43)  # same sizes, other pixels
        wrong = greedy_run(llm, raw_prompt(others, model=qwen3_vl_tiny))
        assert_greedy_differ(epd["four_images"], wrong, NEAR_TIE_FLOAT32, "four_images against other images' answer")

        case = cases["two_images"]  # images this engine has not cached under Eric's hash
        monolithic = list(greedy(llm, raw_prompt(case)).outputs[0].token_ids)
        items = encode_case(other.url, case, other.api_key)
        rows = [_rows(other, i) for i in items]
        reference = [_rows(main, i) for i in encode_case(main.url, case, main.api_key)]
        width = rows[0].shape[1] // 3
        for mine, ref in zip(rows, reference):
            torch.testing.assert_close(mine[:, :width], ref[:, :width])  # merged tokens equal
            assert not torch.allclose(mine[:, width : 2 * width], ref[:, width : 2 * width])  # level 1 perturbed
            torch.testing.assert_close(mine[:, 2 * width :], ref[:, 2 * width :])  # level 2 equal
        perturbed = list(greedy(llm, epd_prompt(case, items), items).outputs[0].token_ids)
        assert perturbed != monolithic
        del llm


def _rows(eric: EricServer, item: dict) -> torch.Tensor:
    fetched = httpx.get(item["handle"]["http"], headers=eric.headers | {LEASE_HEADER: item["handle"]["lease"]})
    assert fetched.status_code == 200, fetched.text
    return load_safetensors(fetched.content)["embedding"]


def test_moe_checkpoint_tower_equals_hf(qwen3_vl_moe_tiny: Path) -> None:
    """Qwen3-VL-MoE shares the tower: Eric's encoder for it equals transformers' at every DeepStack level."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(qwen3_vl_moe_tiny, dtype=torch.float32).eval()
    processor, encoder = load_processor(qwen3_vl_moe_tiny), load_encoder(qwen3_vl_moe_tiny, torch.float32, "cpu")
    for image in _images()[:2]:
        item = processor.process_image(image)
        pixels, grid = torch.from_numpy(item.float_pixels()), torch.tensor([list(item.grid_thw)])
        ours = encoder(pixels, grid)
        with torch.no_grad():
            out = model.model.get_image_features(pixels, grid)
        ref = torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_video_processor_equals_hf(qwen3_vl_tiny: Path) -> None:
    """Eric's Qwen3-VL video path equals Qwen3VLVideoProcessor on the same frames (one pixel budget for the clip,
    odd frame counts padded), samples the frames it samples, and states each temporal step's time as vLLM does."""
    from transformers import AutoVideoProcessor
    from vllm.model_executor.models.qwen3_vl import Qwen3VLProcessingInfo

    from eric_epd.models.qwen3_vl_processor import sampled_frames

    hf_video = AutoVideoProcessor.from_pretrained(qwen3_vl_tiny)
    ours = load_processor(qwen3_vl_tiny)
    rng = np.random.default_rng(5)
    for frames, (h, w) in ((4, (72, 96)), (5, (50, 130)), (9, (160, 160))):
        video = rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8)
        ref = hf_video(videos=[video], do_sample_frames=False, return_tensors="np")
        item = ours.process_video(video, 2.0)
        assert list(item.grid_thw) == ref["video_grid_thw"][0].tolist()
        np.testing.assert_array_equal(item.float_pixels(), ref["pixel_values_videos"])
    for total, fps in ((8, 4.0), (61, 30.0), (300, 24.0), (3, 1.0)):
        metadata = type("M", (), {"total_num_frames": total, "fps": fps})()
        expected = hf_video.sample_frames(metadata, fps=2.0).tolist()
        assert ours.frame_indices(total, fps) == expected
        calc = Qwen3VLProcessingInfo._calculate_timestamps
        seconds = [i / fps for i in expected]
        item = ours.process_video(np.zeros((len(expected), 64, 64, 3), np.uint8), 2.0, seconds)
        assert list(item.timestamps) == calc(None, expected, fps, 2)
    assert sampled_frames(8, 4.0, 2.0, 4, 768) == [0, 2, 5, 7]
