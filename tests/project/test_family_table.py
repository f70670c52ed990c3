"""The README's family table is the code's: every family the checkpoint builders know, with the modalities and TP
Eric serves it at and the test proving each engine runs it behind Eric (eric_epd/checkpoints/support.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from eric_epd.checkpoints import audio_families, builtin, families
from eric_epd.checkpoints.support import FAMILY_SUPPORT, family_table, is_proof

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- families: python -m eric_epd\.checkpoints\.support -->\n(.*?)\n<!-- /families -->", re.S)


def test_readme_table_is_the_generated_one() -> None:
    found = BLOCK.search((ROOT / "README.md").read_text())
    assert found, "README.md has no family table between its markers"
    assert found.group(1) == family_table(), "README's family table is stale: python -m eric_epd.checkpoints.support"


def test_every_family_is_listed_once() -> None:
    listed = [f.model_type for f in FAMILY_SUPPORT]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(builtin.FAMILIES) | set(families.FAMILIES) | set(audio_families.AUDIO_FAMILIES)
    assert {f.model_type for f in FAMILY_SUPPORT if f.generic} == set(families.FAMILIES) | set(
        audio_families.AUDIO_FAMILIES
    )


FIXTURES = {"qwen3_omni_moe": "qwen3_omni_tiny", "kimi_k25": "kimi"}
"""A family's checkpoint fixture where it is not named `<model_type>_tiny`."""


def _runs(plan: str, path: str, model_type: str) -> bool:
    """Whether a test of `path` in pytest's setup plan runs `model_type`: a test id naming it as a parameter, or a test
    that uses its tiny checkpoint's fixture (a module proving one family)."""
    tests = [line.strip() for line in plan.splitlines() if line.strip().startswith(f"{path}::")]
    fixture = FIXTURES.get(model_type, f"{model_type}_tiny")
    named = re.compile(rf"[\[-]{model_type}[\]-]|[ (]{fixture}[,)]")
    return any(named.search(test) for test in tests)


def test_every_proof_is_a_test_module_that_runs_the_family() -> None:
    """Each cell naming a test module names one with a test that runs the family (in pytest's setup plan: a test
    parametrized by it, or one using its checkpoint), not merely a file that mentions it."""
    proofs = {cell for f in FAMILY_SUPPORT for cell in (f.vllm, f.sglang) if is_proof(cell)}
    for family in FAMILY_SUPPORT:
        for cell in (family.vllm, family.sglang):
            if not is_proof(cell):
                assert cell.startswith(("no:", "not ")), f"{family.name}: {cell!r} is neither a test nor a reason"
                continue
            assert (ROOT / cell).exists(), f"{family.name}: {cell} does not exist"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--setup-plan", "-q", "-p", "no:cacheprovider", *sorted(proofs)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    missing = [
        f"{family.model_type}: {cell}"
        for family in FAMILY_SUPPORT
        for cell in (family.vllm, family.sglang)
        if is_proof(cell) and not _runs(done.stdout, cell, family.model_type)
    ]
    assert not missing, f"cells naming a test module none of whose tests runs the family: {missing}"


def test_a_module_that_only_mentions_a_family_is_no_proof() -> None:
    plan = (
        "tests/x.py::test_a[gemma3] (fixtures used: stack)\n"
        "tests/x.py::test_b (fixtures used: qwen2_vl_tiny)\n"
        "tests/y.py::test_c (fixtures used: qwen3_5_moe_tiny)  # qwen3_5 mentioned\n"
    )
    assert _runs(plan, "tests/x.py", "gemma3") and _runs(plan, "tests/x.py", "qwen2_vl")
    assert not _runs(plan, "tests/x.py", "qwen3_5") and not _runs(plan, "tests/y.py", "qwen3_5")
    assert not _runs(plan, "tests/x.py", "gemma3n") and not _runs(plan, "tests/y.py", "gemma3")
