"""Shared by the real-SGLang-server tests (tests/sglang/test_sglang_server*.py): the checkpoint copy with noise vision
weights, the flags, the requests, and one family's servers with SGLang alone's answers kept per content."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from eric_epd.stack.servers import EricServer, GatewayServer
from eric_epd.testing.exactness import Greedy
from eric_epd.testing.media import image_data_url, video_data_url
from eric_epd.testing.sglang_cpu import SglangServe
from eric_epd.testing.stack import ask_greedy

TRANSFERS = ("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake", "nixl")
TEXT = "Describe them."
IMAGES = [image_data_url(84 + 28 * i, 56, seed=40 + i) for i in range(3)]
VIDEOS = [video_data_url(8, 64, 48, 4, seed=3), video_data_url(8, 64, 48, 4, seed=4)]
MM_CONFIG = '{"video": {"min_pixels": 12544}}'
"""SGLang's --mm-process-config, given to Eric too: a smaller first resize than SGLang's default 128 x 28 x 28 pixels a
frame (the test videos are 64 x 48), and the proof that Eric follows the prefills' setting."""
ERIC_FLAGS = ("--dtype", "float32", "--sglang-dtype", "float32", "--sglang-allowed-peer", "127.0.0.1/32")
ERIC_FLAGS += ("--sglang-mm-process-config", MM_CONFIG)
"""The prefills run --dtype float32; the NIXL session ids they send come from 127.0.0.1 (Eric accepts those only from
an allowed peer: a UCX address could name any host)."""
SGLANG_FLAGS = ("--mm-process-config", MM_CONFIG)


def with_noise_vision(model: Path, out: Path) -> Path:
    """A copy of `model` whose vision tower weights (`visual.` tensors) are seeded noise of the same shapes."""
    shutil.copytree(model, out)
    gen = torch.Generator().manual_seed(7)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        visual = [n for n in tensors if ".visual." in f".{n}"]
        assert visual, f"no vision tensors in {path}"
        for name in visual:
            t = tensors[name]
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.5
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def chat(server: SglangServe, content: list[dict]) -> Greedy:
    """Eight greedy tokens of a one-turn chat with `content`, each step's two best logprobs (the openai client)."""
    return ask_greedy(server.url, [{"role": "user", "content": content}], max_tokens=8)


def images(*urls: str, text: str = TEXT) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": text}]


def video(url: str, text: str = "What happens?") -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]


def items_used(eric: EricServer, modality: str) -> float:
    """Items of `modality` Eric answered, encoded or from its cache (eric_items_total)."""
    text = httpx.get(eric.url + "/metrics", headers=eric.headers, timeout=10).text
    prefix = f'eric_items_total{{modality="{modality}",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


class Family:
    """One family's servers: Eric, SGLang alone, and SGLang language-only per transfer; answers kept per content."""

    def __init__(self, eric: EricServer, alone: SglangServe, language_only: dict[str, SglangServe]) -> None:
        self.eric, self.alone, self.language_only = eric, alone, language_only
        self._alone: dict[str, Greedy] = {}
        self.gateways: dict[str, GatewayServer] = {}
        """"epd": the gateway before SGLang alone and the zmq_to_scheduler language-only server; "eric_down": before
        SGLang alone and `eric_down`."""
        self.eric_down: SglangServe | None = None
        """A language-only server whose only encoder refuses connections (Qwen2-VL only)."""

    def reference(self, key: str, content: list[dict]) -> Greedy:
        """SGLang alone's answer to `content` (asked once)."""
        if key not in self._alone:
            self._alone[key] = chat(self.alone, content)
        return self._alone[key]

    def through_eric(self, transfer: str, content: list[dict], modality: str, count: int) -> Greedy:
        """The language-only server's answer over `transfer`; Eric answers `count` items of `modality` for it."""
        before = items_used(self.eric, modality)
        got = chat(self.language_only[transfer], content)
        assert items_used(self.eric, modality) - before == count, f"Eric did not answer the {count} {modality} items"
        return got


def family_servers(
    model: Path, logs: Path, name: str, transfers: tuple[str, ...]
) -> tuple[EricServer, SglangServe, dict[str, SglangServe]]:
    """`model`'s Eric, SGLang alone, and a language-only SGLang per transfer on a noise-vision copy of `model`."""
    eric = EricServer(model, extra_args=ERIC_FLAGS, log_path=logs / f"eric-{name}.log")
    alone = SglangServe(model, logs / f"alone-{name}.log", extra_args=SGLANG_FLAGS)
    noise = with_noise_vision(model, logs / f"{name}-noise-vision")
    language_only = {
        t: SglangServe(noise, logs / f"lo-{name}-{t}.log", (eric.url,), t, SGLANG_FLAGS) for t in transfers
    }
    return eric, alone, language_only
