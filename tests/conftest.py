"""Shared fixtures: offline tiny checkpoints in a per-session cache, and test media."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built checkpoints go to one directory per test session (servers started by tests inherit it)."""
    cache = Path(os.environ.get("ERIC_EPD_TEST_CACHE") or tmp_path_factory.mktemp("eric-cache"))
    os.environ["ERIC_EPD_CACHE"] = str(cache)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per vLLM instance: the tests' models are tiny
    return cache


def _tiny_fixture(family: str):
    """A session fixture: the offline tiny checkpoint of `family`, built into the session's cache."""

    @pytest.fixture(scope="session")
    def fixture(_checkpoint_cache: Path) -> Path:
        from eric_epd.testing.checkpoints import ensure_checkpoint

        return ensure_checkpoint(family, "tiny")

    return fixture


qwen2_vl_tiny = _tiny_fixture("qwen2_vl")
qwen2_5_vl_tiny = _tiny_fixture("qwen2_5_vl")
qwen3_vl_tiny = _tiny_fixture("qwen3_vl")
qwen3_vl_moe_tiny = _tiny_fixture("qwen3_vl_moe")
qwen3_5_tiny = _tiny_fixture("qwen3_5")
qwen3_5_moe_tiny = _tiny_fixture("qwen3_5_moe")


@pytest.fixture(scope="session")
def vllm_behind_erics(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two Erics (one shared key) and one colocated `vllm serve` behind them, shared by every test that puts a
    gateway in front (one vLLM per configuration per session). A test that stops an Eric starts it again."""
    from eric_epd.stack.process import new_key, running
    from eric_epd.stack.servers import EricServer, VllmServe

    logs = tmp_path_factory.mktemp("epd-backend")
    key = new_key()
    erics = [EricServer(qwen2_vl_tiny, log_path=logs / f"eric{i}.log", api_key=key) for i in range(2)]
    vllm = VllmServe(qwen2_vl_tiny, logs / "vllm.log", eric_urls=[e.url for e in erics], eric_api_key=key)
    with running(vllm, *erics):  # their start-ups overlap
        yield {"erics": erics, "vllm": vllm, "eric_key": key}
