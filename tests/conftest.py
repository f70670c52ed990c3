"""Shared fixtures: offline tiny checkpoints in a per-session cache, and test media."""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _instruction_set() -> str | None:
    """Under scripts/test_other_isa.sh this process (its references) runs on the lower instruction set and the
    servers it starts on the host's best."""
    from eric_epd.testing.exactness import move_this_process

    return move_this_process()


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built checkpoints go to one directory per test session (servers started by tests inherit it)."""
    cache = Path(os.environ.get("ERIC_EPD_TEST_CACHE") or tmp_path_factory.mktemp("eric-cache"))
    os.environ["ERIC_EPD_CACHE"] = str(cache)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per vLLM instance: the tests' models are tiny
    return cache


@pytest.fixture(autouse=True)
def _pool_books(monkeypatch: pytest.MonkeyPatch):
    """Every embedding pool a test makes in this process (Eric's, Geri's, a bare one): after the test its accounting
    adds up exactly (EmbeddingPool.audit), so used bytes are exactly 0 whenever nothing is held."""
    from eric_epd.testing.pools import assert_books_exact
    from eric_epd.transfer.pool import EmbeddingPool

    made: list[EmbeddingPool] = []
    init = EmbeddingPool.__init__

    def recorded(self: EmbeddingPool, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(EmbeddingPool, "__init__", recorded)
    yield
    for pool in made:
        assert_books_exact(pool)


def _tiny_fixture(family: str):
    """A session fixture: the offline tiny checkpoint of `family`, built into the session's cache."""

    @pytest.fixture(scope="session")
    def fixture(_checkpoint_cache: Path) -> Path:
        from eric_epd.checkpoints.builtin import ensure_checkpoint

        return ensure_checkpoint(family, "tiny")

    return fixture


qwen2_vl_tiny = _tiny_fixture("qwen2_vl")
qwen2_5_vl_tiny = _tiny_fixture("qwen2_5_vl")
qwen3_vl_tiny = _tiny_fixture("qwen3_vl")
qwen3_vl_moe_tiny = _tiny_fixture("qwen3_vl_moe")
qwen3_5_tiny = _tiny_fixture("qwen3_5")
qwen3_5_moe_tiny = _tiny_fixture("qwen3_5_moe")


@pytest.fixture(scope="session")
def qwen2_audio_tiny(_checkpoint_cache: Path) -> Path:
    """The offline tiny Qwen2-Audio checkpoint (checkpoints/audio_families.py), built into the session's cache."""
    from eric_epd.checkpoints.audio_families import ensure_audio_checkpoint

    return ensure_audio_checkpoint("qwen2_audio")


@pytest.fixture(scope="session")
def qwen2_5_omni_tiny(_checkpoint_cache: Path) -> Path:
    """The offline tiny Qwen2.5-Omni checkpoint (thinker only; checkpoints/audio_families.py), built into the
    session's cache."""
    from eric_epd.checkpoints.audio_families import ensure_audio_checkpoint

    return ensure_audio_checkpoint("qwen2_5_omni")


@pytest.fixture(scope="session")
def qwen3_omni_tiny(_checkpoint_cache: Path) -> Path:
    """The offline tiny Qwen3-Omni-MoE checkpoint (thinker only; checkpoints/audio_families.py), built into the
    session's cache."""
    from eric_epd.checkpoints.audio_families import ensure_audio_checkpoint

    return ensure_audio_checkpoint("qwen3_omni_moe")


@pytest.fixture(scope="session")
def vllm_behind_erics(qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two Erics (one shared key) and one colocated `vllm serve` behind them, shared by every test that puts a
    gateway in front (one vLLM per configuration per session). A test that stops an Eric starts it again."""
    from eric_epd.stack.process import new_key, running
    from eric_epd.stack.servers import EricServer, VllmServe

    logs = tmp_path_factory.mktemp("epd-backend")
    key = new_key()
    erics = [
        EricServer(qwen2_vl_tiny, log_path=logs / f"eric{i}.log", api_key=key, media_hosts=("127.0.0.1",))
        for i in range(2)
    ]  # tests/security/test_url_tricks.py's media origin is on loopback
    vllm = VllmServe(qwen2_vl_tiny, logs / "vllm.log", eric_urls=[e.url for e in erics], eric_api_key=key)
    with running(vllm, *erics):  # their start-ups overlap
        yield {"erics": erics, "vllm": vllm, "eric_key": key}


@pytest.fixture(scope="session")
def qwen2_audio_servers(qwen2_audio_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """One Eric and one `vllm serve` with the connector behind it for the tiny Qwen2-Audio (float32, started
    together), shared by the audio tests that talk to vLLM straight or put a gateway in front."""
    from eric_epd.stack.process import running
    from eric_epd.stack.servers import EricServer, VllmServe

    logs = tmp_path_factory.mktemp("audio-backend")
    eric = EricServer(qwen2_audio_tiny, log_path=logs / "eric.log", extra_args=("--dtype", "float32"))
    vllm = VllmServe(qwen2_audio_tiny, logs / "vllm.log", eric_urls=[eric.url], eric_api_key=eric.api_key)
    with running(eric, vllm):
        yield {"eric": eric, "vllm": vllm}


# Tests that compare two implementations (Eric's tower and transformers' or vLLM's, Geri and diffusers), two batch
# shapes or two instruction sets: `scripts/test_other_isa.sh` runs them (-m exactness) on another instruction set than
# the host's best, so a comparison exact only by one CPU's luck fails there rather than on a user's machine. A module
# is one if it calls a comparison helper (COMPARISONS), or is listed (its comparison is in a helper of tests/support).
COMPARISONS = re.compile(
    r"\b(assert_greedy_agree|assert_greedy_differ|relative_error|assert_rounds_from|assert_floats_close|assert_close|"
    r"assert_allclose|check_equal)\("
)
EXACTNESS_MODULES = {
    "test_audio",
    "test_audio_server",
    "test_gemma3_tower",
    "test_omni_server",
    "test_processor",
    "test_qwen3_omni",
    "test_qwen3_omni_server",
}


@cache
def _compares(path: Path) -> bool:
    return path.stem in EXACTNESS_MODULES or COMPARISONS.search(path.read_text()) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _compares(item.path):
            item.add_marker(pytest.mark.exactness)
