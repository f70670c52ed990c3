"""A real Eric (router, engine, worker) on the tiny Qwen2-Audio checkpoint: audio items posted as data: URLs (wav,
flac, mp3, ogg; odd lengths, rates and channel counts), file:// and http:// URLs are answered with rows, fetched over
the transfer path with each item's lease, equal to transformers' full model's audio features on the samples vLLM's
loader gives; audio items share batches; bad audio gets a 4xx naming the problem and the server keeps serving; a
client that leaves cancels its audio items and their pool space comes back."""

from __future__ import annotations

import functools
import io
import re
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch

from eric_epd.stack.servers import EricServer
from eric_epd.testing.media import AUDIO_FORMATS, audio_bytes, data_url
from tests.support.audio_reference import transformers_audio_rows
from tests.support.helpers_servers import embedding_rows, encode_items, post_raw, stopped

RTOL = 1e-5
"""Worst relative error against transformers in float32: the same modules on the same features (the server's CPU may
round batched matmuls otherwise)."""

CLIPS = (
    ("wav", 3 * 16000 + 7, 16000, 1),
    ("flac", 2 * 44100 + 5, 44100, 2),
    ("mp3", 22050 + 11, 22050, 2),
    ("ogg", 5 * 8000 + 3, 8000, 1),
)
"""(format, frames, rate, channels) of the clips one request carries."""


def _audio_url(fmt: str, frames: int, rate: int, channels: int, seed: int = 0) -> str:
    return data_url(audio_bytes(frames, rate, channels, fmt, seed), AUDIO_FORMATS[fmt][2])


@pytest.fixture(scope="module")
def eric(qwen2_audio_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EricServer]:
    root = tmp_path_factory.mktemp("audio-files")
    with EricServer(
        qwen2_audio_tiny,
        log_path=root / "eric.log",
        media_hosts=("127.0.0.1",),  # a loopback origin
        extra_args=(
            "--dtype",
            "float32",
            "--max-audio-seconds",
            "40",
            "--max-audio-channels",
            "2",
            "--file-root",
            str(root),
        ),
    ) as server:
        server.root = root  # type: ignore[attr-defined]
        yield server


def _references(model_dir: Path) -> list[torch.Tensor]:
    """Per clip, transformers' full-model audio rows on the samples vLLM's loader gives, resampled as vLLM does."""
    from vllm.multimodal.media.audio import load_audio

    clips = []
    for fmt, frames, rate, channels in CLIPS:
        samples, native = load_audio(io.BytesIO(audio_bytes(frames, rate, channels, fmt)), sr=None)
        clips.append((samples, int(native)))
    return transformers_audio_rows(model_dir, clips)


def _metric(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_audio_items_are_answered_with_transformers_rows(eric: EricServer, qwen2_audio_tiny: Path) -> None:
    card = httpx.get(eric.url + "/v1/models", headers=eric.headers).json()["data"][0]
    assert card["modalities"] == ["audio"] and card["placement"] == "media" and card["takes_audio"] is True
    resp = encode_items(
        eric,
        [
            {"id": fmt, "modality": "audio", "url": _audio_url(fmt, frames, rate, channels)}
            for fmt, frames, rate, channels in CLIPS
        ],
    )
    assert resp.status_code == 200, resp.text
    answers = resp.json()["items"]
    for answer, ref, (fmt, *_rest) in zip(answers, _references(qwen2_audio_tiny), CLIPS):
        assert answer["id"] == fmt and answer["modality"] == "audio" and answer["placement"] == "media"
        assert answer["num_tokens"] == answer["shape"][0] == ref.shape[0] and answer["shape"][1] == 64
        rows = embedding_rows(eric, answer)
        assert rows.dtype == torch.float32 and rows.shape == ref.shape
        assert float((rows - ref).abs().max() / ref.abs().max()) <= RTOL, fmt
    metrics = httpx.get(eric.url + "/metrics").text
    encoded = _metric(metrics, "eric_items_total", 'modality="audio",source="encoded"')
    batches = _metric(metrics, "eric_batches_total", 'modalities="audio"')
    assert encoded >= len(CLIPS) and 1 <= batches < encoded  # audio items shared batches


def test_file_and_http_urls_take_the_same_policy_and_give_the_same_item(eric: EricServer) -> None:
    wav = audio_bytes(16000 + 1, 16000, 1, "wav", seed=9)
    root: Path = eric.root  # type: ignore[attr-defined]
    (root / "clip.wav").write_bytes(wav)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as origin:
        threading.Thread(target=origin.serve_forever, daemon=True).start()
        try:
            urls = [
                data_url(wav, "audio/wav"),
                (root / "clip.wav").as_uri(),
                f"http://127.0.0.1:{origin.server_address[1]}/clip.wav",
            ]
            resp = encode_items(eric, [{"modality": "audio", "url": url} for url in urls])
        finally:
            origin.shutdown()
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    assert len({item["hash"] for item in items}) == 1  # one content, one hash: encoded once
    assert torch.equal(embedding_rows(eric, items[0]), embedding_rows(eric, items[2]))
    outside = encode_items(eric, [{"modality": "audio", "url": "file:///etc/hostname"}])
    assert outside.status_code == 403 and "outside the allowed file roots" in outside.text, outside.text


BAD = (
    ("undecodable", "data:audio/wav;base64,UklGRiQAAABXQVZFbm90IGF1ZGlv", 400, "could not decode audio"),
    ("over the duration limit", _audio_url("wav", 41 * 8000, 8000, 1), 413, "--max-audio-seconds"),
    ("too many channels", _audio_url("flac", 8000, 8000, 3), 413, "--max-audio-channels"),
    ("too short for a token", _audio_url("wav", 300, 16000, 1), 400, "too short"),
    ("an image", "data:image/png;base64,iVBORw0KGgo=", 400, "unsupported modality"),
)


@pytest.mark.parametrize(("name", "url", "status", "named"), BAD, ids=[case[0] for case in BAD])
def test_bad_audio_gets_a_4xx_naming_it_and_the_server_keeps_serving(
    eric: EricServer, name: str, url: str, status: int, named: str
) -> None:
    modality = "image" if name == "an image" else "audio"
    resp = encode_items(eric, [{"modality": modality, "url": url}])
    assert resp.status_code == status, (name, resp.text)
    assert named in resp.json()["error"]["message"], resp.text
    good = encode_items(eric, [{"modality": "audio", "url": _audio_url("wav", 16000, 16000, 1, seed=3)}])
    assert good.status_code == 200, good.text


def _state(eric: EricServer) -> tuple[int, int, int]:
    """(pool bytes held, items queued, items running)."""
    pool = httpx.get(eric.url + "/v1/transfer", headers=eric.headers, timeout=10).json()
    health = httpx.get(eric.url + "/health", timeout=10).json()
    return pool["used_bytes"], health["queued_items"], health["running_items"]


def test_a_client_that_leaves_cancels_its_audio_items(eric: EricServer) -> None:
    """Four new clips posted while the worker is stopped, the client gone before any could be answered: the request
    counts as a 499, its items leave the queue and their pool space comes back; the server then answers again."""
    held, _, _ = _state(eric)
    aborted = _metric(httpx.get(eric.url + "/metrics").text, "eric_requests_total", 'status="499"')
    worker = httpx.get(eric.url + "/health", timeout=10).json()["worker_pids"][0]
    body = {
        "items": [{"modality": "audio", "url": _audio_url("wav", 16000 + k, 16000, 1, seed=500 + k)} for k in range(4)]
    }
    with stopped(worker):
        sock = post_raw(eric.port, "/v1/encode", body, eric.headers)
        time.sleep(1.0)  # its clips decode and queue behind the stopped worker (any stage is cancelled alike)
        sock.close()
        deadline = time.monotonic() + 60
        while _metric(httpx.get(eric.url + "/metrics").text, "eric_requests_total", 'status="499"') == aborted:
            assert time.monotonic() < deadline, "the router never saw the client leave"
            time.sleep(0.2)
    deadline = time.monotonic() + 60
    while _state(eric) != (held, 0, 0):
        assert time.monotonic() < deadline, f"not drained: {_state(eric)}, held before {held}"
        time.sleep(0.2)
    good = encode_items(eric, [{"modality": "audio", "url": _audio_url("wav", 16000, 16000, 1, seed=4)}])
    assert good.status_code == 200, good.text
