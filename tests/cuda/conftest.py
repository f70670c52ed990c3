"""GPU tests (marker `cuda`): run with `pytest -m cuda tests/cuda` on a host with CUDA; CPU CI deselects them."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cuda/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _cuda_required() -> None:
    """Selected on purpose (-m cuda), a GPU test without a GPU is a failure, not a skip."""
    assert torch.cuda.is_available(), "tests/cuda needs a CUDA device (deselect with -m 'not cuda')"


def need_devices(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, {torch.cuda.device_count()} visible")
