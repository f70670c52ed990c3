"""`--model org/name` like vLLM: resolved through huggingface_hub's cache with HF_HUB_OFFLINE, fetching only the
configs and the shards that hold encoder weights (here a cache laid out as the hub lays it out, the language
model's shard absent: Eric loads without it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eric_epd.models.hub import encoder_shards, is_repo_id
from eric_epd.models.qwen2_vl import VISION_PREFIXES
from eric_epd.models.registry import load_encoder

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(src: Path, cache: Path) -> Path:
    """models--org--tiny-vl with refs/main and one snapshot: the checkpoint re-sharded (vision / language) with an
    index; only the vision shard is present, as after an encoder-only download."""
    repo = cache / "models--org--tiny-vl"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, snapshot / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    vision = {k: v for k, v in tensors.items() if k.startswith(VISION_PREFIXES)}
    shards = {
        "model-00001-of-00002.safetensors": vision,
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in vision},
    }
    weight_map = {name: file for file, part in shards.items() for name in part}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file(vision, str(snapshot / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    return snapshot


def test_repo_id_resolves_through_the_offline_cache(qwen2_vl_tiny: Path, tmp_path: Path) -> None:
    snapshot = _hub_cache(qwen2_vl_tiny, tmp_path / "hub")
    assert encoder_shards(snapshot, VISION_PREFIXES) == ["model-00001-of-00002.safetensors"]
    assert is_repo_id("Qwen/Qwen2.5-VL-7B-Instruct") and not is_repo_id("../x/y") and not is_repo_id("/models/x")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = "from eric_epd.models.hub import resolve_model; import sys; print(resolve_model(sys.argv[1], sys.argv[2]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "org/tiny-vl", "main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    resolved = Path(out.stdout.strip().splitlines()[-1])
    assert resolved.resolve() == snapshot.resolve()
    # the encoder loads from the snapshot although the language model's shard was never fetched
    ours = load_encoder(resolved, torch.float32, "cpu").state_dict()
    reference = load_encoder(qwen2_vl_tiny, torch.float32, "cpu").state_dict()
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    missing = subprocess.run(
        [sys.executable, "-m", "eric_epd", "serve", "--model", "org/absent"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode != 0 and "--model org/absent" in missing.stderr


@pytest.mark.parametrize("bad", ["not a path", "/no/such/dir"])
def test_neither_directory_nor_repo_id(bad: str) -> None:
    from eric_epd.models.hub import resolve_model

    with pytest.raises(ValueError, match="neither a checkpoint directory nor"):
        resolve_model(bad)
