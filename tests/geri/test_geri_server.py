"""Geri served (`eric-epd geri` on the built-in tiny Qwen-Image): its PNGs are the 8-bit roundings of float images
within IMAGE_FLOAT_BOUND of diffusers' QwenImagePipeline for the same embeddings, seed and steps at TP 1 (on another
instruction set than this process) and 2, concurrent requests of one size batch together, bad input gets a 400
naming the problem while the server goes on serving, and a killed worker fails in-flight requests with 503."""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from eric_epd.checkpoints.qwen_image import ensure_qwen_image_checkpoint
from eric_epd.stack.servers import GeriServer
from eric_epd.testing.exactness import assert_rounds_from, other_isa_env
from eric_epd.testing.server import PoolServer
from eric_epd.testing.stack import unkeyed_answers
from eric_epd.wire.geri import MAX_PROMPT_TOKENS, generate_body
from tests.support.helpers_servers import read_and_ack

HIDDEN = 128  # the tiny checkpoint's joint_attention_dim


def _embeds(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, HIDDEN)).astype(np.float32)


REQUESTS = [
    (_embeds(12, 1), None, {"height": 64, "width": 64, "steps": 2, "seed": 11}),
    (_embeds(9, 3), _embeds(5, 4), {"height": 32, "width": 96, "steps": 3, "seed": 13, "guidance_scale": 4.0}),
]


@pytest.fixture(scope="module")
def pipeline():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(
        ensure_qwen_image_checkpoint("tiny"), torch_dtype=torch.float32, text_encoder=None, tokenizer=None
    )


def _reference(pipeline, prompt: np.ndarray, negative: np.ndarray | None, settings: dict) -> np.ndarray:
    """diffusers' own pipeline on the same embeddings, seed and steps: floats in [0, 1] before rounding to 8 bits
    (Geri's loop and batch shapes order the float sums differently, so only the rounding of near values is fixed)."""
    kwargs = {}
    if negative is not None:
        kwargs = {
            "negative_prompt_embeds": torch.from_numpy(negative)[None],
            "negative_prompt_embeds_mask": torch.ones(1, negative.shape[0], dtype=torch.long),
        }
    out = pipeline(
        prompt_embeds=torch.from_numpy(prompt)[None],
        prompt_embeds_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
        height=settings["height"],
        width=settings["width"],
        num_inference_steps=settings["steps"],
        true_cfg_scale=settings.get("guidance_scale", 4.0),
        generator=torch.Generator().manual_seed(settings["seed"]),
        output_type="np",
        **kwargs,
    )
    return out.images[0]


def _generate(geri: GeriServer, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(geri.url + "/v1/generate", headers=geri.headers, json=body, timeout=timeout)


def _image(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))


@pytest.fixture(scope="module")
def producer() -> Iterator[PoolServer]:
    """A model-free producer (Eric's pool, backends and embedding API) holding prompt embeddings."""
    with PoolServer(backends="shm", pool_bytes=16 << 20) as server:
        yield server


@pytest.fixture(scope="module")
def geri(producer: PoolServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeriServer]:
    """TP 1 on the built-in default checkpoint (no --model), reading handles from `producer` alone, on another
    instruction set than this process's reference pipeline."""
    with GeriServer(
        log_path=tmp_path_factory.mktemp("geri") / "geri.log",
        env=other_isa_env(),
        extra_args=("--embedding-producers", producer.url),
    ) as server:
        yield server


def test_served_images_equal_diffusers_pipeline_at_tp1(geri: GeriServer, pipeline) -> None:
    for prompt, negative, settings in REQUESTS:
        image = _image(_generate(geri, generate_body(prompt, negative, **settings)))
        assert image.shape == (settings["height"], settings["width"], 3)
        assert_rounds_from(image, _reference(pipeline, prompt, negative, settings))
        assert image.std() > 0


def test_tp2_images_equal_diffusers_pipeline(tmp_path: Path, pipeline) -> None:
    """The transformer split over two gloo ranks by heads (each row-parallel layer sums two partial products)."""
    with GeriServer(tp=2, cpus=tuple(sorted(os.sched_getaffinity(0))), log_path=tmp_path / "geri-tp2.log") as geri2:
        workers = httpx.get(geri2.url + "/health").json()["workers"]
        assert len(workers) == 2
        for prompt, negative, settings in REQUESTS:
            image = _image(_generate(geri2, generate_body(prompt, negative, **settings)))
            assert_rounds_from(image, _reference(pipeline, prompt, negative, settings))


def test_concurrent_requests_of_one_size_batch_and_each_gets_its_own_image(geri: GeriServer, pipeline) -> None:
    bodies = [(_embeds(4 + i, 20 + i), {"height": 64, "width": 64, "steps": 3, "seed": 100 + i}) for i in range(4)]
    before = _metric(geri, "geri_batch_items_sum"), _metric(geri, "geri_batch_items_count")
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda b: _generate(geri, generate_body(b[0], **b[1])), bodies))
    for (prompt, settings), response in zip(bodies, responses):
        assert_rounds_from(_image(response), _reference(pipeline, prompt, None, settings))
    items = _metric(geri, "geri_batch_items_sum") - before[0]
    batches = _metric(geri, "geri_batch_items_count") - before[1]
    assert items == 4 and batches < 4  # at least two requests rode in one batch


def _metric(geri: GeriServer, name: str) -> float:
    for line in httpx.get(geri.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _safetensors_b64(tensors: dict[str, np.ndarray]) -> str:
    from safetensors.numpy import save

    return base64.b64encode(save(tensors)).decode()


def test_bad_input_gets_a_400_naming_it_and_the_server_goes_on(geri: GeriServer) -> None:
    good = generate_body(_embeds(3, 0), height=32, width=32, steps=1, seed=0)
    nan = _embeds(3, 0)
    nan[1, 2] = np.nan
    cases = [
        ({**good, "embeddings": _safetensors_b64({"prompt_embeds": _embeds(3, 0)[:, :100]})}, "must be [tokens, 128]"),
        (
            {**good, "embeddings": _safetensors_b64({"prompt_embeds": np.zeros((0, HIDDEN), np.float32)})},
            "has 0 tokens",
        ),
        ({**good, "height": 62}, "height 62 must be a multiple of 4"),
        ({**good, "width": 4096}, "width 4096 must be a multiple of 4 up to 1024"),
        ({**good, "height": 100_000, "width": 100_000}, "height 100000 must be"),  # checked before a slot is sized
        ({**good, "steps": 100_000}, "steps 100000 must be 1 to 100"),
        ({**good, "steps": 0}, "steps 0"),
        ({**good, "guidance_scale": 1e9}, "guidance_scale"),
        ({**good, "seed": -1}, "seed -1"),
        ({**good, "embeddings": "not base64!"}, "base64 safetensors"),
        ({**good, "embeddings": base64.b64encode(b"\x00" * 64).decode()}, "safetensors"),
        ({**good, "embeddings": _safetensors_b64({"prompt": _embeds(3, 0)})}, "must hold 'prompt_embeds'"),
        ({**good, "embeddings": _safetensors_b64({"prompt_embeds": nan})}, "non-finite"),
        (
            {
                **good,
                "embeddings": _safetensors_b64(
                    {"prompt_embeds": _embeds(3, 0), "negative_prompt_embeds": _embeds(2, 0)[:, :64]}
                ),
            },
            "hidden size",
        ),
        ({**good, "handle": {"hash": "x"}}, "unknown field"),
        ({"height": 64}, "embeddings"),
    ]
    for body, named in cases:
        r = _generate(geri, body)
        assert r.status_code == 400, (named, r.text)
        assert named.lower() in r.json()["error"]["message"].lower(), (named, r.text)
    assert httpx.post(geri.url + "/v1/generate", headers=geri.headers, content=b"{" * 10_000).status_code == 400
    assert httpx.post(geri.url + "/v1/generate", json=good).status_code == 401  # no key
    assert httpx.get(geri.url + "/health").status_code == 200
    assert _image(_generate(geri, good)).shape == (32, 32, 3)


def test_a_prompt_past_the_kept_tokens_gives_the_image_of_its_kept_rows(geri: GeriServer) -> None:
    """Qwen-Image keeps a prompt's first MAX_PROMPT_TOKENS rows (of each, with a negative); Geri cuts the rest as it
    reads the request (they never reach the engine), and the image is the one of the cut rows; a change within them
    changes it (the control)."""
    long, negative = _embeds(MAX_PROMPT_TOKENS + 88, 7), _embeds(MAX_PROMPT_TOKENS + 3, 8)
    settings = {"height": 32, "width": 32, "steps": 2, "seed": 5, "guidance_scale": 3.0}
    full = _image(_generate(geri, generate_body(long, negative, **settings)))
    kept = _image(_generate(geri, generate_body(long[:MAX_PROMPT_TOKENS], negative[:MAX_PROMPT_TOKENS], **settings)))
    np.testing.assert_array_equal(full, kept)
    changed = long[:MAX_PROMPT_TOKENS].copy()
    changed[-1] += 1.0
    assert not np.array_equal(_image(_generate(geri, generate_body(changed, negative, **settings))), kept)


def _held(producer: PoolServer, rows: np.ndarray, key: str) -> dict:
    """A handle on `rows` (float32) held by the producer."""
    r = httpx.post(
        producer.url + "/v1/testing/entries",
        timeout=30,
        json={
            "hash": key,
            "data": base64.b64encode(rows.tobytes()).decode(),
            "shape": list(rows.shape),
            "dtype": "float32",
        },
    )
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k != "leases"}


def test_embeddings_by_handle_give_the_inline_image(geri: GeriServer, producer: PoolServer) -> None:
    """Prompt and negative embeddings read over shm from the producer: the same PNG as inline, the leases acked."""
    prompt, negative, settings = REQUESTS[1]
    inline = _image(_generate(geri, generate_body(prompt, negative, **settings)))
    body = {
        "prompt_handle": _held(producer, prompt, "p1"),
        "negative_handle": _held(producer, negative, "n1"),
        **settings,
    }
    np.testing.assert_array_equal(_image(_generate(geri, body)), inline)
    assert httpx.get(producer.url + "/v1/transfer").json()["entries"] == 0  # read once, acknowledged, freed
    again = _generate(geri, body)  # the leases are spent
    assert again.status_code == 404 and "prompt_handle" in again.json()["error"]["message"], again.text
    unknown = {**_held(producer, prompt, "p2"), "hash": "f" * 64}
    unknown["http"] = f"{producer.url}/v1/embeddings/{unknown['hash']}"
    r = _generate(geri, {"prompt_handle": unknown, **settings})
    assert r.status_code == 404, r.text
    elsewhere = {**_held(producer, prompt, "p3"), "producer": "http://10.0.0.9:8100"}
    r = _generate(geri, {"prompt_handle": elsewhere, **settings})
    assert r.status_code == 400 and "not one of the configured producers" in r.json()["error"]["message"], r.text
    narrow = _held(producer, prompt[:, :64].copy(), "p4")
    r = _generate(geri, {"prompt_handle": narrow, **settings})
    assert r.status_code == 400 and "[rows, 128]" in r.json()["error"]["message"], r.text
    both = {**generate_body(prompt), "prompt_handle": _held(producer, prompt, "p5")}
    assert _generate(geri, both).status_code == 400
    huge = {**_held(producer, prompt, "p6"), "shape": [2**40, prompt.shape[1]]}  # a shape nothing could allocate
    huge["nbytes"] = 2**40 * prompt.shape[1] * 4
    r = _generate(geri, {"prompt_handle": huge, **settings})
    assert r.status_code == 400 and f"{2**40} tokens; 1 to " in r.json()["error"]["message"], r.text
    # refused for its settings before its handle is read: the lease is not spent, and the retry is served
    refused = {"prompt_handle": _held(producer, prompt, "p7"), **settings, "steps": 10_000}
    r = _generate(geri, refused)
    assert r.status_code == 400 and "steps" in r.json()["error"]["message"], r.text
    assert _generate(geri, {**refused, **settings}).status_code == 200


def test_killed_worker_fails_inflight_requests_with_503_and_health(tmp_path: Path, producer: PoolServer) -> None:
    """In-flight requests fail with 503 once the worker dies, and so does /health; a request by handle is refused
    before its handle is read, so the lease is still there for a retry on another Geri."""
    with GeriServer(log_path=tmp_path / "geri.log", extra_args=("--embedding-producers", producer.url)) as geri:
        pid = httpx.get(geri.url + "/health").json()["worker_pids"][0]
        os.kill(pid, signal.SIGSTOP)  # requests pile up in flight ...
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(_generate, geri, generate_body(_embeds(3, i), height=64, width=64, steps=2, seed=i), 30)
                for i in range(3)
            ]
            time.sleep(1.0)
            assert not any(f.done() for f in futures)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)  # ... then the worker dies under them
            responses = [f.result(timeout=20) for f in futures]
        assert time.monotonic() - killed_at < 10
        for r in responses:
            assert r.status_code == 503 and "worker rank 0" in r.json()["error"]["message"], r.text
        health = httpx.get(geri.url + "/health", timeout=10)
        assert health.status_code == 503 and "worker rank 0" in health.json()["reason"]
        assert _generate(geri, generate_body(_embeds(3, 0), height=32, width=32, steps=1)).status_code == 503
        held = _held(producer, _embeds(3, 0), "dead-geri")
        r = _generate(geri, {"prompt_handle": held, "height": 32, "width": 32, "steps": 1})
        assert r.status_code == 503 and "worker rank 0" in r.json()["error"]["message"], r.text
    read_and_ack(producer, {"hash": held["hash"], "handle": held})  # not read, not acknowledged: both succeed


def test_every_geri_route_needs_the_key(geri: GeriServer) -> None:
    answers = unkeyed_answers(geri.url, geri.headers)
    assert ("POST", "/v1/generate") in answers
    opened = {route: status for route, status in answers.items() if status != 401}
    assert {path for _, path in opened} <= {"/health", "/ready", "/metrics"}, opened
