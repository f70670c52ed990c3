"""The README's family table is the code's: every family the checkpoint builders know, with the modalities and TP
Eric serves it at and the test proving EPD through each engine (eric_epd/checkpoints/support.py)."""

from __future__ import annotations

import re
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


def test_every_proof_is_a_test_module_that_runs_the_family() -> None:
    for family in FAMILY_SUPPORT:
        for cell in (family.vllm, family.sglang):
            if not is_proof(cell):
                assert cell.startswith(("no:", "not ")), f"{family.name}: {cell!r} is neither a test nor a reason"
                continue
            path = ROOT / cell
            assert path.exists(), f"{family.name}: {cell} does not exist"
            text = path.read_text()
            assert family.model_type in text or "vllm_proven" in text, f"{cell} never names {family.model_type}"
