"""Processor: decodes media (images, videos, audio) and runs the model's ModalityProcessor in a thread pool; computes
the content hash."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import numpy as np

from eric_epd.eric.decode import decode_image, decode_video
from eric_epd.eric.sglang.video import SglangVideo
from eric_epd.eric.video_limits import VideoBudget
from eric_epd.media.audio import decode_audio
from eric_epd.media.limits import MediaLimits
from eric_epd.media.url_policy import MediaError
from eric_epd.models.facts import ModelFacts
from eric_epd.models.processor import BaseModalityProcessor, ProcessedItem

logger = logging.getLogger(__name__)


def _lower_thread_priority() -> None:
    """Preprocessing yields the CPU to the encoder workers: on a host where they share cores, a preprocessing
    thread that preempts one OpenMP thread of a matmul stalls the whole parallel region. Linux sets nice per
    thread; elsewhere this is a no-op."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@dataclass(frozen=True)
class PreparedItem:
    """A preprocessed item and its content hash (the key used everywhere downstream)."""

    hash: str
    item: ProcessedItem
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """How long decoding, preprocessing and hashing took (observed by the caller, on the event loop)."""
    aliased: bool = False
    """Found by its raw bytes (eric/alias.py): `item` carries the metadata only, no tensors; it is answered from a
    lease on its pool entry and never submitted to the engine."""


def model_fingerprint(facts: ModelFacts, precision: tuple[str, str]) -> bytes:
    """What identifies the encoder's output space: the vision config, a digest of the vision weights (a fine-tuned
    tower under the same config gives other hashes), not the path it was loaded from, and `precision` (the dtype the
    tower computes in, that of the rows it sends: tower_precision), as rows computed in bfloat16 are not those
    computed in float32."""
    from eric_epd.models.registry import vision_weights_digest

    start = time.perf_counter()
    vision = {
        "model_type": facts.model_type,
        "vision_config": facts.config.get("vision_config"),
        "vision_weights": vision_weights_digest(facts.model_dir, facts.config),
        "precision": list(precision),
    }
    logger.info("vision weights digest %s in %.2fs", vision["vision_weights"], time.perf_counter() - start)
    return json.dumps(vision, sort_keys=True, default=str).encode()


def tower_precision(compute_setting: str, row_setting: str, device_type: str, facts: ModelFacts) -> tuple[str, str]:
    """(compute dtype, row dtype) of this Eric's workers: --compute-dtype and --dtype resolved as each worker resolves
    them (models/compute_dtype.py) on `device_type`. The router shares its host, and so its CPU's units, with them."""
    from eric_epd.models.compute_dtype import choose_compute_dtype, cpu_units

    rows = facts.output_dtype(row_setting)
    units = cpu_units() if device_type == "cpu" else frozenset()
    return choose_compute_dtype(compute_setting, rows, device_type, units)[0], rows


class Processor:
    """Turns fetched bytes into PreparedItems off the event loop."""

    def __init__(
        self,
        modality_processor: BaseModalityProcessor,
        limits: MediaLimits,
        threads: int,
        model_id: bytes,
        sglang_video: SglangVideo | None = None,
    ) -> None:
        self._mp = modality_processor
        self._sglang_video = sglang_video
        """How SGLang's own encoder prepares this model's videos (its Qwen-VL families), for videos asked for on
        SGLang's protocol; None: as vLLM does."""
        self._limits = limits
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(
            max_workers=self._threads, thread_name_prefix="eric-preprocess", initializer=_lower_thread_priority
        )
        self._video_pool = ThreadPoolExecutor(
            max_workers=self._threads, thread_name_prefix="eric-video", initializer=_lower_thread_priority
        )
        """Videos decode here, one item a task: however many a client sends, images and audio never queue behind
        them."""
        self._salt = {m: self._hash_salt(m, model_id) for m in modality_processor.modalities}

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities the model's processor accepts."""
        return self._mp.modalities

    @property
    def salts(self) -> dict[str, bytes]:
        """Each modality's content-hash salt: the model's fingerprint, the modality, the processor's fingerprint and
        the video sampling (what the raw-bytes alias keys on too)."""
        return dict(self._salt)

    def _hash_salt(self, modality: str, model_id: bytes) -> bytes:
        sampling = b""
        if modality == "video":
            sampling = f"fps={self._limits.video_fps};max={self._limits.max_video_frames}".encode()
        return hashlib.sha256(
            model_id + b"\0" + modality.encode() + b"\0" + self._mp.fingerprint(modality) + b"\0" + sampling
        ).digest()

    async def prepare_many(
        self, items: list[tuple[str, bytes]], sglang: bool = False
    ) -> list[PreparedItem | MediaError]:
        """Every item prepared, in order, each its PreparedItem or its MediaError. Images and audio go to the pool in
        one contiguous chunk per thread: a hop to the pool and back costs about as much as preprocessing a small
        image, so a request of small images pays it once per thread, not once per item. Each video goes to the video
        pool on its own, under the request's VideoBudget. Cancelled (the client
        left), the chunks stop before their next item. `sglang=True`: as SGLang's own encoder reads them (audio without
        hop padding; Qwen-VL videos sampled and resized first as SGLang does), under other content hashes."""
        loop, stop = asyncio.get_running_loop(), threading.Event()
        budget = VideoBudget(self._limits, stop)
        others = _chunks([i for i, (modality, _) in enumerate(items) if modality != "video"], self._threads)
        videos = [[i] for i, (modality, _) in enumerate(items) if modality == "video"]
        runs = [
            loop.run_in_executor(self._pool, self._prepare_chunk, [items[i] for i in c], stop, sglang) for c in others
        ]
        runs += [
            loop.run_in_executor(self._video_pool, self._prepare_chunk, [items[i] for i in c], stop, sglang, budget)
            for c in videos
        ]
        try:
            done = await asyncio.gather(*runs)
        except BaseException:
            stop.set()
            raise
        results: dict[int, PreparedItem | MediaError] = {}
        for chunk, prepared in zip(others + videos, done, strict=True):
            results.update(zip(chunk, prepared, strict=True))
        return [results[i] for i in range(len(items))]

    def _prepare_chunk(
        self,
        items: list[tuple[str, bytes]],
        stop: threading.Event,
        sglang: bool = False,
        budget: VideoBudget | None = None,
    ) -> list[PreparedItem | MediaError]:
        out: list[PreparedItem | MediaError] = []
        for modality, data in items:
            if stop.is_set():
                break
            try:
                out.append(self._prepare_sync(modality, data, stop, sglang, budget))
            except MediaError as e:
                out.append(e)
        return out

    def _prepare_sync(
        self,
        modality: str,
        data: bytes,
        stop: threading.Event | None = None,
        sglang: bool = False,
        budget: VideoBudget | None = None,
    ) -> PreparedItem:
        start = time.perf_counter()
        tag = ""
        try:
            if modality == "image":
                image = decode_image(data, self._limits)
                pixels = np.asarray(image)
                decoded = time.perf_counter()
                item = self._mp.process_image(image)
            elif modality == "audio":
                audio = decode_audio(data, self._limits, stop)
                pixels, tag = audio.samples, f"@{audio.sample_rate}Hz" + ("|unpadded" if sglang else "")
                decoded = time.perf_counter()
                item = self._mp.process_audio(audio.samples, audio.sample_rate, hop_padded=not sglang)
            elif sglang and self._sglang_video is not None:
                like = self._sglang_video
                pixels, _, seconds = decode_video(data, self._limits, like.frame_indices, stop, budget)
                decoded, tag = time.perf_counter(), "|sglang:" + like.fingerprint().decode() + _timing(2.0, seconds)
                item = self._mp.process_video(like.resize(pixels), 2.0, seconds)  # SGLang gives no fps: HF's 2.0
            else:
                pixels, sampled_fps, seconds = decode_video(data, self._limits, self._mp.frame_indices, stop, budget)
                decoded, tag = time.perf_counter(), _timing(sampled_fps, seconds)
                item = self._mp.process_video(pixels, sampled_fps, seconds)
        except ValueError as e:  # the model's processor refuses this input (e.g. its aspect ratio)
            raise MediaError(400, f"the model's processor refuses this {modality}: {e}") from e
        processed = time.perf_counter()
        key = self._content_hash(modality, pixels, tag)
        return PreparedItem(key, item, (decoded - start, processed - decoded, time.perf_counter() - processed))

    def _content_hash(self, modality: str, pixels: np.ndarray, tag: str = "") -> str:
        """BLAKE3 (256 bits) over the modality's salt, the decoded values' shape (and `tag`: an audio item's sample
        rate, a video's timing) and the values themselves: a third of sha256's time on a 448 px image's pixels."""
        h = blake3.blake3(self._salt[modality], max_threads=1)
        h.update(str(pixels.shape).encode() + tag.encode())
        h.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
        return h.hexdigest()

    def close(self) -> None:
        """Stop the preprocessing threads, dropping work not yet started."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._video_pool.shutdown(wait=False, cancel_futures=True)


def _timing(sampled_fps: float, seconds: tuple[float, ...]) -> str:
    """A video's hash tag for its timing: the same frames at other times (another frame rate) are another video to
    an engine (Qwen3-VL's timestamps, Qwen2.5-VL's seconds per grid step), whatever rows the tower gives them."""
    return f"|{sampled_fps!r}fps|" + ",".join(map(repr, seconds))


def _chunks(items: list, n: int) -> list[list]:
    """`items` split into at most `n` contiguous chunks of near-equal length."""
    n = max(1, min(n, len(items)))
    size, extra = divmod(len(items), n)
    bounds = [i * size + min(i, extra) for i in range(n + 1)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]
