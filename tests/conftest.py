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


@pytest.fixture(scope="session")
def qwen2_vl_tiny(_checkpoint_cache: Path) -> Path:
    from eric_epd.testing.checkpoints import ensure_checkpoint

    return ensure_checkpoint("qwen2_vl", "tiny")


@pytest.fixture(scope="session")
def qwen2_5_vl_tiny(_checkpoint_cache: Path) -> Path:
    from eric_epd.testing.checkpoints import ensure_checkpoint

    return ensure_checkpoint("qwen2_5_vl", "tiny")
