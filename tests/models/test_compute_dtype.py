"""`--compute-dtype`: the choice of the dtype Eric's tower computes in (each device and CPU case, without the
hardware), the refusal of an unknown value, and the worker's runner (built by the workload as a worker builds it) on
the tiny Qwen2.5-VL: float32 compute with bfloat16 rows is the float32 tower's rows cast to bfloat16 exactly, and
bfloat16 compute stays within a stated bound of float32's, which another image's rows exceed."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch

from eric_epd.eric import cli
from eric_epd.eric.config import EricConfig
from eric_epd.eric.workload import EncoderRunner, encoder_workload, work_item
from eric_epd.media.synthetic import random_image
from eric_epd.models.compute_dtype import choose_compute_dtype, compute_dtype, cpu_units
from eric_epd.models.facts import ModelFacts
from eric_epd.models.layers import attention
from eric_epd.models.layers.parallel import TPContext
from eric_epd.models.registry import load_processor
from eric_epd.runtime.executor.device_io import DeviceIO
from eric_epd.testing.exactness import BFLOAT16_TOWER_FROM_FLOAT32, relative_error

NO_UNITS: frozenset[str] = frozenset()
BF16_UNITS = frozenset({"avx512_bf16"})
AMX = frozenset({"amx_bf16"})
FP16_UNITS = frozenset({"avx512_fp16", "amx_fp16"})
SIZES = ((112, 84), (140, 112))
"""Two image sizes (token counts differ), run in one batch."""


@pytest.mark.parametrize(
    ("setting", "rows", "device", "units", "chosen", "reason"),
    [
        ("auto", "bfloat16", "cuda", NO_UNITS, "bfloat16", "on cuda the tower computes in the rows' dtype"),
        ("auto", "float16", "cuda", NO_UNITS, "float16", "on cuda"),
        ("auto", "bfloat16", "cpu", BF16_UNITS, "bfloat16", "this CPU has AVX512-BF16"),
        ("auto", "bfloat16", "cpu", AMX | BF16_UNITS, "bfloat16", "AVX512-BF16 and AMX-BF16"),
        ("auto", "bfloat16", "cpu", FP16_UNITS, "float32", "this CPU has no AVX512-BF16 or AMX-BF16"),
        ("auto", "bfloat16", "cpu", NO_UNITS, "float32", "no AVX512-BF16 or AMX-BF16"),
        ("auto", "float16", "cpu", FP16_UNITS, "float16", "AVX512-FP16 and AMX-FP16"),
        ("auto", "float16", "cpu", AMX | BF16_UNITS, "float32", "this CPU has no AVX512-FP16 or AMX-FP16"),
        ("auto", "float32", "cpu", NO_UNITS, "float32", "the rows are float32"),
        ("auto", "float32", "cpu", AMX, "float32", "the rows are float32"),
        ("auto", "float32", "cuda", NO_UNITS, "float32", "on cuda"),
        ("bfloat16", "bfloat16", "cpu", NO_UNITS, "bfloat16", "--compute-dtype bfloat16"),
        ("float32", "bfloat16", "cuda", NO_UNITS, "float32", "--compute-dtype float32"),
    ],
)
def test_choice(setting: str, rows: str, device: str, units: frozenset[str], chosen: str, reason: str) -> None:
    """auto: the rows' dtype on CUDA and for float32 rows; on a CPU, a half-precision row dtype only where the CPU has
    units for it, else float32; an explicit setting is taken as it is. The reason names what decided."""
    dtype, why = choose_compute_dtype(setting, rows, device, units)
    assert dtype == chosen and reason in why, (dtype, why)


def test_unknown_compute_dtype_is_refused(tmp_path: Path) -> None:
    """The config, the choice and the flag refuse a dtype they do not know."""
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        EricConfig(model=tmp_path, compute_dtype="int8")
    with pytest.raises(ValueError, match="compute dtype must be one of"):
        choose_compute_dtype("fp8", "bfloat16", "cpu", NO_UNITS)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--compute-dtype", "float32"]).compute_dtype == "float32"
    assert parser.parse_args(["serve"]).compute_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--compute-dtype", "int8"])


def _runner(checkpoint: Path, dtype: str, compute: str) -> EncoderRunner:
    """The runner a CPU worker loads for `eric-epd serve --dtype DTYPE --compute-dtype COMPUTE`."""
    config = EricConfig(model=checkpoint, dtype=dtype, compute_dtype=compute, device="cpu")
    workload = encoder_workload(config, ModelFacts.from_checkpoint(checkpoint), config.compile, config.compute_dtype)
    runner = workload.load(config, torch.device("cpu"), TPContext())
    assert isinstance(runner, EncoderRunner)
    return runner


def _rows(runner: EncoderRunner, checkpoint: Path, seed: int) -> list[torch.Tensor]:
    """A batch of SIZES' images of `seed` through `runner` as a worker runs it: the inputs staged by DeviceIO (cast to
    the runner's compute dtype), the forward under inference mode."""
    processor = load_processor(checkpoint)
    items = [processor.process_image(random_image(w, h, seed + i)) for i, (w, h) in enumerate(SIZES)]
    work = [work_item(f"item{i}", item, 0, 0) for i, item in enumerate(items)]
    inputs = DeviceIO(torch.device("cpu"), None).inputs(
        [torch.from_numpy(item.pixel_values).reshape(-1) for item in items], runner.dtype
    )
    with torch.inference_mode():
        return runner.run(work, inputs)


def test_worker_logs_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    """The worker's one INFO line names the dtype chosen, why, and the cast when the rows differ."""
    with caplog.at_level(logging.INFO, logger="eric_epd.models.compute_dtype"):
        assert compute_dtype("float32", torch.bfloat16, torch.device("cpu")) is torch.float32
        assert compute_dtype("auto", torch.float32, torch.device("cpu")) is torch.float32
    assert [r.getMessage() for r in caplog.records] == [
        "computing the tower in float32: --compute-dtype float32; rows are cast to bfloat16",
        "computing the tower in float32: the rows are float32",
    ]
    assert cpu_units() <= {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}


@pytest.mark.parametrize("gemms", [False, True], ids=["flash-attention", "gemm-attention"])
def test_runner_computes_in_one_dtype_and_sends_another(
    qwen2_5_vl_tiny: Path, monkeypatch: pytest.MonkeyPatch, gemms: bool
) -> None:
    """float32 compute with bfloat16 rows: the float32 tower's rows cast to bfloat16, bit for bit. bfloat16 compute,
    its attention by torch's SDPA or by bfloat16 GEMMs (as on a CPU with AVX512-BF16 and no AMX), whatever this CPU:
    within BFLOAT16_TOWER_FROM_FLOAT32 of the float32 rows; the negative control, another image's bfloat16 rows
    (same sizes), is not, nor are the float32 rows with noise at ten times the bound."""
    monkeypatch.setattr(attention, "_bf16_gemm_attention", lambda: gemms)
    reference = _rows(_runner(qwen2_5_vl_tiny, "float32", "auto"), qwen2_5_vl_tiny, seed=0)
    cast = _runner(qwen2_5_vl_tiny, "bfloat16", "float32")
    assert cast.dtype is torch.float32 and cast.row_dtype is torch.bfloat16
    for ours, ref in zip(_rows(cast, qwen2_5_vl_tiny, seed=0), reference, strict=True):
        assert ours.dtype is torch.bfloat16 and torch.equal(ours, ref.to(torch.bfloat16))
    half = _runner(qwen2_5_vl_tiny, "bfloat16", "bfloat16")
    assert half.dtype is torch.bfloat16 and half.row_dtype is torch.bfloat16
    other = _rows(half, qwen2_5_vl_tiny, seed=10)
    noise = torch.Generator().manual_seed(0)
    for i, (ours, wrong, ref) in enumerate(zip(_rows(half, qwen2_5_vl_tiny, seed=0), other, reference, strict=True)):
        assert ours.dtype is torch.bfloat16 and ours.shape == ref.shape
        error = relative_error(ours, ref)
        assert error <= BFLOAT16_TOWER_FROM_FLOAT32, f"image {i}: bfloat16 rows {error:.3g} from float32"
        wrong_error = relative_error(wrong, ref)
        assert wrong_error > BFLOAT16_TOWER_FROM_FLOAT32, f"image {i}: another image's rows pass ({wrong_error:.3g})"
        scale = 10 * BFLOAT16_TOWER_FROM_FLOAT32 * ref.abs().max()
        noisy = ref + scale * torch.randn(ref.shape, generator=noise).sign()
        assert relative_error(noisy, ref) > BFLOAT16_TOWER_FROM_FLOAT32
