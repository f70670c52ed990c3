"""The dtype Eric's tower computes in (`--compute-dtype`), apart from the dtype of the rows it sends (`--dtype`: the
engine's model dtype, which Mooncake/NIXL landing buffers are read in): the runner casts its rows to the row dtype
before they leave it, so nothing downstream of the tower sees the compute dtype.

"auto" computes in the row dtype, except on a CPU without units for a half-precision row dtype (bfloat16:
AVX512-BF16 or AMX-BF16; float16: AVX512-FP16 or AMX-FP16), where it computes in float32: without them torch's
half-precision GEMMs run far slower than float32's (10.8 against 89 GFLOP/s for bfloat16 on an AVX2-only CPU,
README). The choice is a pure function of the CPU's facts (choose_compute_dtype); compute_dtype asks
torch for them on the worker and logs the choice with its reason. Importing this module imports no torch."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["COMPUTE_DTYPES", "UNITS", "choose_compute_dtype", "compute_dtype", "cpu_units"]

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The --compute-dtype values (EricConfig.compute_dtype)."""

UNITS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "bfloat16": MappingProxyType({"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}),
        "float16": MappingProxyType({"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}),
    }
)
"""By half-precision dtype: the CPU units that compute it natively, as torch.cpu.get_capabilities() names them, and
as the log names them. A CPU with one of them computes in that dtype; one without computes in float32."""

_OLD_PROBES: Mapping[str, str] = MappingProxyType(
    {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
)
"""torch.cpu's probes in the releases before get_capabilities; every CPU with AMX tiles has AMX-BF16."""


def choose_compute_dtype(setting: str, row_dtype: str, device_type: str, cpu_units: frozenset[str]) -> tuple[str, str]:
    """(the dtype the tower computes in, why) for a --compute-dtype `setting`, rows sent in `row_dtype` ("float32",
    "bfloat16" or "float16"), on `device_type` ("cpu" or "cuda"), on a CPU with `cpu_units` (UNITS' names it has)."""
    if setting not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}, got {setting!r}")
    if setting != "auto":
        return setting, f"--compute-dtype {setting}"
    if device_type != "cpu":
        return row_dtype, f"on {device_type} the tower computes in the rows' dtype"
    units = UNITS.get(row_dtype)
    if units is None:
        return row_dtype, f"the rows are {row_dtype}"
    have = [label for name, label in units.items() if name in cpu_units]
    if have:
        return row_dtype, f"this CPU has {' and '.join(have)}"
    return "float32", f"this CPU has no {' or '.join(units.values())}"


def cpu_units() -> frozenset[str]:
    """The UNITS this process's CPU has, by torch's own probes."""
    import torch

    names = {name for units in UNITS.values() for name in units}
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return frozenset(name for name in names if found.get(name) is True)
    return frozenset(name for name, probe in _OLD_PROBES.items() if getattr(torch.cpu, probe, lambda: False)())


def compute_dtype(setting: str, row_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype this worker's tower computes in (choose_compute_dtype on this CPU's facts), logged with its reason."""
    import torch

    rows = str(row_dtype).removeprefix("torch.")
    name, reason = choose_compute_dtype(
        setting, rows, device.type, cpu_units() if device.type == "cpu" else frozenset()
    )
    cast = f"; rows are cast to {rows}" if name != rows else ""
    logger.info("computing the tower in %s: %s%s", name, reason, cast)
    return getattr(torch, name)
