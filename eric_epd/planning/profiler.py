"""`eric-epd profile`: for each device share it is given, start Eric alone and measure its frontier, then `vllm serve`
alone (fed precomputed embeddings, prefix caching off) and measure the engine's side; write one JSON profile. The
servers start through the Servers given (planning/servers.py), never the stack's launchers directly."""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from eric_epd.planning.costs import stage_costs
from eric_epd.planning.measure_engine import image_tokens, measure_engine
from eric_epd.planning.measure_eric import measure_eric
from eric_epd.planning.planner import render_host_split
from eric_epd.planning.profiles import Profile, Share, Traffic, write_profile
from eric_epd.planning.servers import Servers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileConfig:
    """What `eric-epd profile` measures, and where."""

    model: Path
    out: Path
    shares: tuple[tuple[int, ...], ...]
    """Each share's device ids: CPU cores (device cpu), or GPUs (device cuda: CUDA_VISIBLE_DEVICES)."""
    traffic: Traffic = field(default_factory=Traffic)
    device: str = "cpu"
    dtype: str = "float32"
    concurrencies: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests_per_point: int = 8
    saturation_requests: int = 16
    """requests of the mix sent to the engine at once for its capacity alone (as many as the load to compare with)"""
    max_model_len: int = 8192
    log_dir: Path | None = None


def _placement(config: ProfileConfig, share: tuple[int, ...]) -> tuple[tuple[int, ...] | None, dict[str, str]]:
    """(CPUs to pin to, environment) of a server on `share`: its cores on CPU; its GPUs on CUDA (any CPUs)."""
    if config.device == "cuda":
        return None, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, share))}
    return share, {}


def profile_share(config: ProfileConfig, share: tuple[int, ...], logs: Path, servers: Servers) -> Share:
    """Eric alone on `share`, then the engine alone on `share`, each started by `servers`."""
    cpus, env = _placement(config, share)
    tag = "-".join(map(str, share))
    tp = len(share) if config.device == "cuda" else 1  # on CPU, one worker on all the share's cores
    with servers.eric(
        config.model,
        tp=tp,
        cpus=cpus,
        env=env,
        log_path=logs / f"eric_{tag}.log",
        extra_args=("--dtype", config.dtype, "--device", config.device),
    ) as eric:
        eric_points = measure_eric(eric, config.traffic, config.concurrencies, config.requests_per_point)
    limits = {"image": max(config.traffic.images_per_request, 1), "video": 0}
    vllm_args = (
        "--enable-mm-embeds",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        str(max(config.batches)),
        "--limit-mm-per-prompt",
        json.dumps(limits),
        "--seed",
        "0",
        *(("--tensor-parallel-size", str(len(share))) if config.device == "cuda" else ()),
    )
    with servers.engine(
        config.model,
        cpus=cpus,
        env=env,
        log_path=logs / f"vllm_{tag}.log",
        extra_args=vllm_args,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
    ) as vllm:
        engine = measure_engine(vllm, config.model, config.traffic, config.batches, config.saturation_requests)
    return Share(devices=share, eric=eric_points, engine=engine)


def _resize_facts(model: Path) -> dict[str, int]:
    """The checkpoint's pixels per image token along a side and its pixel budget (Profile's fields)."""
    vision = json.loads((model / "config.json").read_text())["vision_config"]
    pre = json.loads((model / "preprocessor_config.json").read_text())
    return {
        "token_factor": vision.get("patch_size", 14) * vision.get("spatial_merge_size", 2),
        "min_pixels": pre["min_pixels"],
        "max_pixels": pre["max_pixels"],
    }


def profile(config: ProfileConfig, servers: Servers) -> Profile:
    """Measure every share, its servers started by `servers` (stack/servers.LocalServers: subprocesses on this
    host), and write the profile to config.out."""
    logs = config.log_dir or Path(tempfile.mkdtemp(prefix="eric-epd-profile-"))
    logs.mkdir(parents=True, exist_ok=True)
    model_config = json.loads((config.model / "config.json").read_text())
    shares = []
    for share in config.shares:
        logger.info("profiling %s on %s %s (logs in %s)", config.model.name, config.device, share, logs)
        shares.append(profile_share(config, share, logs, servers))
    result = Profile(
        model=str(config.model),
        device=config.device,
        dtype=config.dtype,
        traffic=config.traffic,
        image_tokens={s: image_tokens(config.model, s) for s in config.traffic.sides},
        cost_ratios=stage_costs(model_config).ratios(),
        shares=shares,
        **_resize_facts(config.model),
    )
    write_profile(result, config.out)
    logger.info("wrote %s\n%s", config.out, render_host_split(result))
    return result
