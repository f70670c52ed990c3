"""The traffic of benchmarks/epd_vs_colocated.py: its series (each a checkpoint size and a `vllm bench serve`
dataset, or a driver of its own), the files they read, their planner view, and the goodput SLO they are judged by."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multiturn import Load, driver  # sibling script (benchmarks/ is on sys.path)

from eric_epd.planning.profiles import Traffic
from eric_epd.testing.media import image_bytes, random_image

OUTPUT_TOKENS = 32
SLO = {"ttft": 10000.0, "tpot": 100.0}
"""Goodput SLO in ms (a request counts when both hold). TPOT 100 ms is ten tokens a second, about reading speed: the
bound an interactive chat needs. TTFT 10 s: a CPU encodes four images of a 3B-shaped model in about a second per
core, so queueing at saturation is what the bound separates."""


@dataclass(frozen=True)
class Series:
    """One traffic series: its checkpoint size, `vllm bench serve` dataset and most images per prompt."""

    name: str
    checkpoint: str
    """size of the offline qwen2_vl checkpoint"""
    dataset: list[str]
    """`vllm bench serve` dataset arguments"""
    max_images: int
    prepare: Callable[[int], None] | None = None
    """Writes the dataset file of one run (its seed replaces "{seed}" in `dataset`)."""
    driver: Callable[[str, str, dict[str, str], int], dict] | None = None
    """Runs the series itself, once, instead of `vllm bench serve` at each rate: (base URL, key, metric servers by
    role, seed) -> its results."""
    limits: dict[str, int] | None = None
    """vLLM's --limit-mm-per-prompt (default: `max_images` images, no video)"""
    gateway_args: tuple[str, ...] = ()
    """Extra flags of EPD's gateway"""


def _buckets(sides: tuple[int, ...]) -> str:
    return "{" + ", ".join(f"({s}, {s}, 1): {1 / len(sides):.4f}" for s in sides) + "}"


def _random_mm(items: int, spread: float, sides: tuple[int, ...], limit: int) -> list[str]:
    return [
        "--dataset-name",
        "random-mm",
        "--random-input-len",
        "64",
        "--random-output-len",
        str(OUTPUT_TOKENS),
        "--random-mm-base-items-per-request",
        str(items),
        "--random-mm-num-mm-items-range-ratio",
        str(spread),
        "--random-mm-limit-mm-per-prompt",
        json.dumps({"image": limit, "video": 0}),
        "--random-mm-bucket-config",
        _buckets(sides),
    ]


def repeat_dataset(path: Path, prompts: int, per_request: int, sides: tuple[int, int], seed: int = 0) -> None:
    """custom_image JSONL: half of each request's images come from a small shared set (they repeat); the other half
    are new to this run (named by its seed)."""
    images = path.parent / "images"
    images.mkdir(parents=True, exist_ok=True)

    def image(name: str, i: int) -> str:
        side = sides[i % len(sides)]
        f = images / f"{name}_{i}.png"
        if not f.exists():
            salt = zlib.crc32(name.encode()) % 997
            f.write_bytes(image_bytes(random_image(side, side, seed=seed * 100_003 + salt * 101 + i)))
        return str(f)

    shared = [image("shared", i) for i in range(per_request)]
    with path.open("w") as out:
        for p in range(prompts):
            fresh = [image(f"fresh{seed}_{p}", i) for i in range(per_request - per_request // 2)]
            files = shared[: per_request // 2] + fresh
            out.write(json.dumps({"prompt": "Describe these images.", "image_files": files}) + "\n")


def make_series(quick: bool, tmp: Path, prompts: int, size: str) -> dict[str, Series]:
    """The traffic series by name: mix (the headline: 4 images of 224 or 448 px), heavy (encoder-heavy: 4-8 images
    up to 672 px), single, repeat (a dataset file written per run; half of each request's images repeat), tiny and
    multiturn (its own driver: 3-turn chats, `prompts` conversations of each shape, half of them at a time)."""
    heavy_sides = (224, 448) if quick else (224, 448, 672)  # 8 images of 896 px would pass the 8192-token context
    repeat = tmp / "repeat_{seed}.jsonl"

    def prepare_repeat(seed: int) -> None:
        repeat_dataset(Path(str(repeat).replace("{seed}", str(seed))), max(prompts, 4), 4, (224, 448), seed)

    return {
        "mix": Series("mix", size, _random_mm(4, 0.0, (224, 448), 4), 4),
        "heavy": Series("heavy", size, _random_mm(6, 0.34, heavy_sides, 8), 8),
        "single": Series("single", size, _random_mm(1, 0.0, (224, 448), 1), 8),
        "repeat": Series(
            "repeat",
            size,
            [
                "--dataset-name",
                "custom_image",
                "--dataset-path",
                str(repeat),
                "--custom-output-len",
                str(OUTPUT_TOKENS),
                "--custom-ensure-client-side-data",
            ],
            8,
            prepare_repeat,
        ),
        "tiny": Series("tiny", "tiny", _random_mm(3, 0.0, (56, 112, 224), 3), 4),
        "multiturn": Series(
            "multiturn",
            "small",
            [],
            4,
            driver=driver(Load(prompts, max(prompts // 2, 1), OUTPUT_TOKENS), Load(2, 2, OUTPUT_TOKENS)),
        ),
    }


def traffic_of(series: Series) -> Traffic:
    """The planner's view of a random-mm series: its items per request and sides, 64 text tokens, the output."""
    i = series.dataset.index("--random-mm-bucket-config")
    sides = tuple(int(side) for side in re.findall(r"\((\d+), \d+, 1\)", series.dataset[i + 1]))
    items = int(series.dataset[series.dataset.index("--random-mm-base-items-per-request") + 1])
    return Traffic(items, sides, 64, OUTPUT_TOKENS)
