"""Eric's generic path (models/hf) on every tiny family checkpoint, as plumbing: Eric's processor and runner give, per
image, the rows transformers' full model gives (get_image_features on its own processor's output, in vLLM's layout;
Llama 4's from the whole forward; Kimi-K2.5's on vLLM's own processor's output), alone and batched; only vision
tensors are read and hashed; a real Eric server answers them over HTTP."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file

from eric_epd.checkpoints.families import FAMILIES, ensure_family_checkpoint
from eric_epd.eric.decode import decode_video
from eric_epd.eric.generic import GenericRunner, GenericWorkload
from eric_epd.eric.workload import encoder_workload, work_item
from eric_epd.media.limits import MediaLimits
from eric_epd.models.facts import GENERIC_VIDEO_TYPES, ModelFacts, generic_modalities
from eric_epd.models.hf.loader import vision_shards, vision_tensor_names
from eric_epd.models.hf.processor import HFImageProcessor
from eric_epd.models.hf.tensors import unpack_tensors
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.registry import load_processor, vision_weights_digest
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.work import WorkItem
from eric_epd.testing.media import data_url, image_bytes, random_image, video_bytes
from eric_epd.wire.handles import LEASE_HEADER
from tests.support.kimi_reference import VllmKimi

pytestmark = pytest.mark.exactness

RTOL = 1e-5
"""Worst relative error allowed (max |ours - transformers'| / max |transformers'|), float32: the same modules run
on the same inputs; a batch of several items changes only the rounding of batched matmuls."""

BF16_RTOL = 3e-2
"""bfloat16 against float32: bfloat16 roundings (2^-8 each) through two blocks and a projector (measured <= 1.4e-2)."""

SIZES = ((150, 100), (90, 200), (150, 100))
"""Wide, tall, and wide again (a second image of the first's shape: its tensors join the first's in one forward)."""

HF_INPUTS = {
    "gemma3": ("pixel_values",),
    "internvl": ("pixel_values",),
    "llava_onevision": ("pixel_values", "image_sizes", "batch_num_images"),
    "mistral3": ("pixel_values", "image_sizes"),
    "glm4v": ("pixel_values", "image_grid_thw"),
    "glm4v_moe": ("pixel_values", "image_grid_thw"),
    "idefics3": ("pixel_values", "pixel_attention_mask"),
    "smolvlm": ("pixel_values", "pixel_attention_mask"),
    "gemma4": ("pixel_values", "image_position_ids"),
    "llama4": ("pixel_values",),
    "kimi_k25": ("pixel_values", "image_grid_thw"),
}
"""What transformers' get_image_features takes per family (its signature), independently of Eric's filtering."""
TILED = {"gemma3", "internvl", "idefics3", "smolvlm"}
"""Families whose features come as [tiles, tokens, hidden] (vLLM flattens the tiles in order); Llama 4's need its
projector first (HF's forward applies it); the others give one tensor per image."""


def _images() -> list[Image.Image]:
    return [random_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module")
def checkpoints(_checkpoint_cache: Path) -> dict[str, Path]:
    return {family: ensure_family_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Per family, per image: transformers' processor outputs, image-token count and rows (full model, float32)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    out: dict[str, list[dict[str, Any]]] = {}
    for family, ckpt in checkpoints.items():
        processor = AutoProcessor.from_pretrained(ckpt)
        token_id = AutoConfig.from_pretrained(ckpt).image_token_id
        model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        text = processor.boi_token if family == "gemma3" else processor.image_token
        vllm = VllmKimi(ckpt) if family == "kimi_k25" else None  # vLLM's own processor, not transformers'
        refs = []
        for image in _images():
            if vllm is None:
                inputs = processor(text=[text], images=[image], return_tensors="pt")
            else:  # tests/models/test_kimi_processor.py
                ref = vllm.inputs(image)
                inputs = {
                    "pixel_values": ref.pixel_values,
                    "image_grid_thw": ref.grid_thw,
                    "input_ids": torch.full((1, ref.tokens), token_id),
                }
            kwargs = {k: inputs[k].float() if inputs[k].is_floating_point() else inputs[k] for k in HF_INPUTS[family]}
            with torch.no_grad():
                features = model.get_image_features(**kwargs)
                if family == "llama4":  # get_image_features stops before the projector: the whole forward's rows
                    rows = _scattered_rows(model, inputs, token_id)
                else:
                    rows = features.pooler_output.flatten(0, 1) if family in TILED else features.pooler_output[0]
            refs.append({"inputs": inputs, "tokens": int((inputs["input_ids"] == token_id).sum()), "rows": rows})
        out[family] = refs
    return out


def _scattered_rows(model: Any, inputs: Any, token_id: int) -> torch.Tensor:
    """The rows transformers' whole forward puts at the prompt's image tokens (its language model's `inputs_embeds`
    there): a reference that shares no layout code with Eric's adapter."""
    seen: dict[str, torch.Tensor] = {}

    def grab(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen["embeds"] = kwargs["inputs_embeds"]

    handle = model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(**{k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    finally:
        handle.remove()
    return seen["embeds"][inputs["input_ids"] == token_id]


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_gives_hf_tensors_and_rows(checkpoints: dict[str, Path], references: dict, family: str) -> None:
    """Eric's items hold transformers' processor tensors bit for bit (Kimi-K2.5's: vLLM's), and as many rows as the
    text has image tokens (the count transformers' forward checks its features against, and vLLM's placeholder
    holds)."""
    processor = load_processor(checkpoints[family])
    assert isinstance(processor, HFImageProcessor) and processor.modalities == generic_modalities(family)
    for image, ref in zip(_images(), references[family]):
        item = processor.process_image(image)
        assert item.num_tokens == ref["tokens"] == ref["rows"].shape[0]
        tensors = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        assert set(HF_INPUTS[family]) <= set(tensors)
        dtypes = {spec.name: spec.dtype for spec in item.tensors}
        for name, tensor in tensors.items():  # floating tensors arrive as float32 (Llama 4's bfloat16 exactly)
            assert dtypes[name] == str(ref["inputs"][name].dtype).removeprefix("torch."), name
            torch.testing.assert_close(
                tensor.to(ref["inputs"][name].dtype), ref["inputs"][name], rtol=0, atol=0, msg=name
            )


def _runner(ckpt: Path, dtype: str = "float32") -> tuple[GenericWorkload, GenericRunner]:
    config = RuntimeConfig(model=ckpt, dtype=dtype, device="cpu")
    workload = encoder_workload(config, ModelFacts.from_checkpoint(ckpt))
    assert isinstance(workload, GenericWorkload)
    return workload, workload.load(config, torch.device("cpu"), TPContext())


def _run(workload: GenericWorkload, runner: GenericRunner, items: list) -> list[torch.Tensor]:
    """A batch as the engine hands it to a worker: validated work items, their frames concatenated (float32)."""
    work: list[WorkItem] = [work_item(f"item{i}", it, 0, 0) for i, it in enumerate(items)]
    for w, it in zip(work, items):
        assert workload.validate(w, it.pixel_values.nbytes) is None
    inputs = torch.cat([torch.from_numpy(it.pixel_values) for it in items]).to(runner.dtype)
    with torch.inference_mode():
        return runner.run(work, inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_equal_transformers(checkpoints: dict[str, Path], references: dict, family: str) -> None:
    """Each image alone, then all three in one batch (the two wide ones joined in one forward, the tall one on its
    own): every item's rows equal transformers' within RTOL, and the same rows one place out of order do not (the
    negative control). Plumbing: Eric calls the same get_image_features (Llama 4's reference is the whole forward),
    so this checks Eric's processing, batching and layout around it; the family's proof is end to end against
    vLLM's own answer (tests/vllm/test_generic_families.py)."""
    workload, runner = _runner(checkpoints[family])
    items = [load_processor(checkpoints[family]).process_image(image) for image in _images()]
    kinds = [work_item("k", it, 0, 0).kind for it in items]
    assert kinds[0] == kinds[2] and kinds[0].startswith("image/")
    refs = [r["rows"] for r in references[family]]
    for item, ref in zip(items, refs):
        (alone,) = _run(workload, runner, [item])
        assert alone.shape == ref.shape and alone.dtype == torch.float32
        assert _relative_error(alone, ref) <= RTOL
        assert _relative_error(alone.roll(1, 0), ref) > RTOL  # rows out of order fail it
    batched = _run(workload, runner, items)
    for i, (ours, ref) in enumerate(zip(batched, refs)):
        assert ours.shape == ref.shape, i
        assert _relative_error(ours, ref) <= RTOL, i


@pytest.mark.parametrize("family", sorted(GENERIC_VIDEO_TYPES))
def test_video_rows_equal_transformers(checkpoints: dict[str, Path], family: str) -> None:
    """Two 40-frame videos, decoded by Eric with the frames vLLM's loader for the family takes (32 uniformly spaced
    for LLaVA-OneVision, InternVL and Gemma 4, 2 a second for GLM-4.1V; tests/vllm/test_generic_placeholders.py
    checks them and Eric's tensors against vLLM's): Eric's tensors are transformers' video processor output bit for
    bit where they are the same tensors, and its rows (each video alone, then both in one forward) transformers'
    own video features within RTOL, as many as the video's tokens. InternVL has no `get_video_features`: its
    forward, like vLLM, runs the frames through `get_image_features`, one tile a frame. Gemma 4's is on its inner
    model; vLLM (and so Eric) runs the frames through the image processor and `get_image_features` instead (pixels
    within 6e-8 of the video processor's; rows measured 3.8e-7 from transformers' video path, 0 from its image
    path)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ckpt = checkpoints[family]
    ours = load_processor(ckpt)
    assert isinstance(ours, HFImageProcessor) and "video" in ours.modalities
    videos = [
        decode_video(video_bytes(40, 64, 48, fps=8, seed=s), MediaLimits(), ours.frame_indices)[0] for s in (1, 2)
    ]
    assert [len(v) for v in videos] == [{"glm4v": 10}.get(family, 32)] * 2
    hf = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    features = (
        getattr(model, "get_video_features", None)
        or getattr(model.model, "get_video_features", None)
        or model.get_image_features
    )
    takes = inspect.signature(features).parameters
    items, refs = [], []
    for video in videos:
        inputs = hf(text=[hf.video_token], videos=[video], do_sample_frames=False, return_tensors="pt")
        with torch.no_grad():
            pooled = features(**{k: v for k, v in inputs.items() if k in takes}).pooler_output
        parts = pooled if isinstance(pooled, tuple) else [pooled]  # one tensor per video, or [1, rows, hidden]
        refs.append(torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]))
        item = ours.process_video(video)
        tensors = unpack_tensors(item.tensors, torch.from_numpy(item.pixel_values))
        for name in tensors.keys() & inputs.keys():
            torch.testing.assert_close(tensors[name], inputs[name].to(tensors[name].dtype), rtol=0, atol=0)
        assert item.num_tokens == refs[-1].shape[0]
        items.append(item)
    workload, runner = _runner(ckpt)
    assert work_item("k", items[0], 0, 0).kind.startswith("video/")
    for item, ref in zip(items, refs):
        (alone,) = _run(workload, runner, [item])
        assert alone.shape == ref.shape and _relative_error(alone, ref) <= RTOL
    for batched, ref in zip(_run(workload, runner, items), refs):
        assert batched.shape == ref.shape and _relative_error(batched, ref) <= RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_rows(checkpoints: dict[str, Path], references: dict, family: str) -> None:
    """Loaded in bfloat16 (as --dtype bfloat16 or a bfloat16 checkpoint), the rows come out in bfloat16, close to
    transformers' float32 rows (bfloat16 keeps 8 bits of mantissa)."""
    workload, runner = _runner(checkpoints[family], "bfloat16")
    items = [load_processor(checkpoints[family]).process_image(image) for image in _images()]
    for ours, ref in zip(_run(workload, runner, items), references[family]):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref["rows"].shape
        assert _relative_error(ours, ref["rows"]) <= BF16_RTOL


def test_only_vision_tensors_are_read_and_hashed(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The digest names the tower and projector: a changed language-model tensor leaves it, a changed vision tensor
    or projector setting moves it; the processor's settings move the items' fingerprint."""
    ckpt = tmp_path / "glm4v"
    shutil.copytree(checkpoints["glm4v"], ckpt)
    names = vision_tensor_names(ckpt)["model.safetensors"]
    assert names and not any(n.startswith(("model.language_model", "lm_head")) for n in names)
    base = vision_weights_digest(ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    language = next(n for n in tensors if n.startswith("model.language_model"))
    tensors[language] = tensors[language] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) == base
    tensors[names[0]] = tensors[names[0]] + 1
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert vision_weights_digest(ckpt) != base

    fingerprint = HFImageProcessor(ckpt).fingerprint("image")
    config = json.loads((ckpt / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.4, 0.5, 0.5]
    (ckpt / "processor_config.json").write_text(json.dumps(config))
    assert HFImageProcessor(ckpt).fingerprint("image") != fingerprint


def test_vision_shards_alone_load_and_hash_alike(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A sharded checkpoint fetched as models/hub.py fetches it (configs, index, and only the shards holding vision
    tensors) loads, gives the same rows, and hashes as the whole one does."""
    from transformers import AutoModelForImageTextToText

    whole, partial = tmp_path / "whole", tmp_path / "partial"
    AutoModelForImageTextToText.from_pretrained(checkpoints["glm4v"]).save_pretrained(whole, max_shard_size="100KB")
    partial.mkdir()
    for path in checkpoints["glm4v"].iterdir():  # the processor's and tokenizer's files
        if path.suffix != ".safetensors" and not (whole / path.name).exists():
            shutil.copy(path, whole / path.name)
    shards = vision_shards(whole)
    assert shards is not None and 0 < len(shards) < len(list(whole.glob("*.safetensors")))
    for path in whole.iterdir():
        if path.suffix != ".safetensors" or path.name in shards:
            shutil.copy(path, partial / path.name)
    assert vision_weights_digest(partial) == vision_weights_digest(whole)
    image = _images()[0]
    rows = [_run(*_runner(ckpt), [load_processor(ckpt).process_image(image)])[0] for ckpt in (whole, partial)]
    assert torch.equal(rows[0], rows[1])


def test_refusals(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """--tp > 1 on the generic path, and a model_type transformers does not know, fail at start and say why."""
    with pytest.raises(ValueError, match="--tp 1 only"):
        glm = checkpoints["glm4v"]
        encoder_workload(RuntimeConfig(model=glm, tp_size=2), ModelFacts.from_checkpoint(glm))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no_such_vlm", "vision_config": {}}')
    with pytest.raises(ValueError, match=r"unsupported model_type 'no_such_vlm'.*qwen2_vl.*generic path.*mistral3"):
        encoder_workload(RuntimeConfig(model=unknown), ModelFacts.from_checkpoint(unknown))


def test_server_answers_transformers_rows(checkpoints: dict[str, Path], references: dict, tmp_path: Path) -> None:
    """A real Eric (router, engine, worker) on LLaVA-OneVision: /v1/encode answers each image with as many rows as
    its placeholder holds, equal to transformers' rows; its card offers video too: a 40-frame video is answered
    with its 32 sampled frames' rows (4 each) and the image_newline row, a broken one with a 400."""
    from eric_epd.stack.servers import EricServer

    with EricServer(
        checkpoints["llava_onevision"], log_path=tmp_path / "eric.log", extra_args=("--dtype", "float32")
    ) as eric:
        models = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
        assert models["modalities"] == ["image", "video"] and models["placement"] == "media"
        items = [
            {"id": str(i), "modality": "image", "url": data_url(image_bytes(image))}
            for i, image in enumerate(_images())
        ]
        resp = httpx.post(eric.url + "/v1/encode", json={"items": items}, headers=eric.headers, timeout=120)
        assert resp.status_code == 200, resp.text
        assert all(item["placement"] == "media" for item in resp.json()["items"])  # vLLM gets the image itself
        for answer, ref in zip(resp.json()["items"], references["llava_onevision"]):
            assert answer["num_tokens"] == answer["shape"][0] == ref["rows"].shape[0]
            handle = answer["handle"]
            fetched = httpx.get(handle["http"], headers=eric.headers | {LEASE_HEADER: handle["lease"]})
            assert fetched.status_code == 200, fetched.text
            rows = load_safetensors(fetched.content)["embedding"]
            assert _relative_error(rows, ref["rows"]) <= RTOL
        broken = httpx.post(
            eric.url + "/v1/encode",
            headers=eric.headers,
            timeout=60,
            json={"items": [{"modality": "video", "url": "data:video/mp4;base64,AAAA"}]},
        )
        assert broken.status_code == 400 and "could not decode video" in broken.text, broken.text
        url = data_url(video_bytes(40, 64, 48, fps=8, seed=1), "video/mp4")
        video = httpx.post(
            eric.url + "/v1/encode",
            headers=eric.headers,
            timeout=60,
            json={"items": [{"modality": "video", "url": url}]},
        )
        assert video.status_code == 200, video.text
        assert video.json()["items"][0]["shape"] == [32 * 4 + 1, 64]


def test_warmup_item_is_valid(checkpoints: dict[str, Path]) -> None:
    """The warm-up every worker runs before the server is ready is a real item of the model's processor."""
    workload = GenericWorkload.from_checkpoint(checkpoints["idefics3"])
    item, frame = workload.warmup(RuntimeConfig(model=checkpoints["idefics3"]))
    assert workload.validate(item, np.asarray(frame).nbytes) is None
