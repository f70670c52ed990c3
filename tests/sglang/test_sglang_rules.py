"""The SGLang adapter's rules without servers: the wire dtype, a video part's seconds per grid, SGLang mm_items as
Eric media URLs, where Eric may push (the caller's address or allowed networks, every resolved address), landing
devices and Mooncake protocol; what a delivery's errors answer."""

from __future__ import annotations

import socket
from typing import Any

import pytest


def test_adapter_rules_without_servers() -> None:
    """SGLang's --dtype auto rule for the wire dtype, and how SGLang's mm_items become Eric media URLs."""
    from eric_epd.eric.sglang.protocol import SglangError, item_url, wire_dtype

    assert wire_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert wire_dtype("auto", {"dtype": "float32"}) == "float16"
    assert wire_dtype("float32", {"dtype": "bfloat16"}) == "float32"
    assert item_url("https://x/a.png", 0) == "https://x/a.png"
    assert item_url({"url": "data:image/png;base64,AAAA", "content_hash": "h"}, 0) == "data:image/png;base64,AAAA"
    assert item_url("/srv/a.png", 0) == "file:///srv/a.png"
    assert item_url("iVBORw0KGgo=", 0) == "data:application/octet-stream;base64,iVBORw0KGgo="
    with pytest.raises(SglangError, match="max_pixels"):
        item_url({"url": "https://x/a.png", "preprocess_kwargs": None, "max_pixels": 4096}, 3)


def test_delivery_errors_answer_as_sglang_does() -> None:
    """The ladder the direct delivery and /send share: an SglangError passes as it is, a push engine's error is a
    500 with its own message, anything else a 500 naming what failed and the error's type."""
    from eric_epd.eric.sglang.protocol import SglangError, as_sglang_error
    from eric_epd.eric.sglang.push import PushError

    own = SglangError(404, "no staged embedding")
    for raised, status, message in (
        (own, 404, "no staged embedding"),
        (PushError("rc=-1"), 500, "rc=-1"),
        (OSError("gone"), 500, "send of req_id=r to h:1 failed: OSError: gone"),
    ):
        with pytest.raises(SglangError) as caught, as_sglang_error("send of req_id=r to h:1 failed"):
            raise raised
        assert (caught.value.status, caught.value.message) == (status, message)
    assert caught.value.__cause__ is raised
    with pytest.raises(SglangError) as caught, as_sglang_error("x"):
        raise own
    assert caught.value is own


def test_video_seconds_per_grid_only_for_qwen3_omni() -> None:
    """The second_per_grid_ts Eric's route sends with a video part: SGLang's own encoder's temporal_patch_size / 2
    for Qwen3-Omni (its receiver's M-RoPE indexes it), none for any other family (their headers are unchanged)."""
    from eric_epd.eric.sglang.protocol import sglang_video_seconds

    vision = {"vision_config": {"temporal_patch_size": 2}}
    assert sglang_video_seconds({"model_type": "qwen3_omni_moe", "thinker_config": vision}) == 1.0
    assert (
        sglang_video_seconds(
            {"model_type": "qwen3_omni_moe", "thinker_config": {"vision_config": {"temporal_patch_size": 4}}}
        )
        == 2.0
    )
    for family in ("qwen2_5_omni", "qwen2_5_vl", "qwen3_vl", "llava_onevision"):
        assert sglang_video_seconds({"model_type": family, "thinker_config": vision, **vision}) is None


def test_peer_policy_rules_without_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Allowed: the caller's own address or inside an allowed network; a name only if every address it resolves
    to is; loopback is no exception. A bad CIDR fails when the config is made."""
    import asyncio
    import ipaddress

    from eric_epd.eric.config import SglangConfig
    from eric_epd.eric.sglang.peers import PeerPolicy
    from eric_epd.eric.sglang.protocol import SglangError

    with pytest.raises(ValueError, match="not a CIDR"):
        SglangConfig(allowed_peers=("10.0.0.0/33",))
    policy = PeerPolicy(SglangConfig(allowed_peers=("10.0.0.0/24", "fd00::/64")).peer_networks)
    names = {"two.example": ["10.0.0.7", "10.0.0.8"], "mixed.example": ["10.0.0.7", "203.0.113.5"]}

    def fake_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list[tuple]:
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)

    def host(name: str, caller: str | None) -> str | int:
        try:
            return asyncio.run(policy.host(name, caller, "host"))
        except SglangError as e:
            return e.status

    assert host("10.0.0.9", "192.0.2.1") == "10.0.0.9"
    assert host("fd00::5", None) == "fd00::5"
    assert host("::ffff:10.0.0.9", None) == "::ffff:10.0.0.9"  # IPv4-mapped: checked as 10.0.0.9
    assert host("192.0.2.1", "192.0.2.1") == "192.0.2.1"  # the caller's own address
    assert host("192.0.2.1", "::ffff:192.0.2.1") == "192.0.2.1"
    assert host("127.0.0.1", "192.0.2.1") == 403  # loopback is just another address
    assert host("10.0.1.1", "192.0.2.1") == 403
    assert host("two.example", None) == "10.0.0.7"
    assert host("mixed.example", None) == 403  # every resolved address must be allowed
    assert host("nowhere.example", None) == 400
    assert asyncio.run(policy.endpoint("[fd00::5]:7000", None, "x")) == "[fd00::5]:7000"
    assert policy.allows_caller("10.0.0.3", "192.0.2.1") and policy.allows_caller("192.0.2.1", "192.0.2.1")
    assert not policy.allows_caller("192.0.2.2", "192.0.2.1") and policy.allows_caller("192.0.2.2", None)
    assert ipaddress.ip_network("10.0.0.0/24") in policy.networks


def test_nixl_landing_buffers_register_on_the_rank_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's receiver passes no gpu_id: each rank's buffers register on its own current CUDA device (rank 1, or
    --base-gpu-id 3), not device 0. The CUDA device is a stand-in (this machine has no GPU)."""
    import torch

    from eric_epd.plugins.sglang.plugin import NixlLandingEngine

    assert NixlLandingEngine("h").device == 0 and NixlLandingEngine("h").mem_type == "DRAM"  # host memory here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current = {"device": 3}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    engine = NixlLandingEngine("h")
    assert engine.mem_type == "VRAM" and engine.device == 3
    current["device"] = 1  # what a rank whose scheduler process set device 1 sees
    assert engine.device == 1
    assert NixlLandingEngine("h", gpu_id=5).device == 5  # an explicit gpu_id wins


def test_mooncake_protocol_follows_sglang_and_advertised_hosts_are_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eric's Mooncake pushes to SGLang use SGLang's protocol (its MOONCAKE_PROTOCOL, default rdma); an address
    advertised to other hosts with a loopback bind is refused at start with a message naming both flags."""
    import argparse

    from eric_epd.eric.cli import add_parser as _serve_parser
    from eric_epd.eric.cli import config_from_args

    def config(*argv: str, env: str | None = None):
        if env is None:
            monkeypatch.delenv("MOONCAKE_PROTOCOL", raising=False)
        else:
            monkeypatch.setenv("MOONCAKE_PROTOCOL", env)
        parser = argparse.ArgumentParser()
        _serve_parser(parser.add_subparsers(dest="command"))
        return config_from_args(parser.parse_args(["serve", *argv]))

    assert config().sglang.mooncake_protocol == "rdma" and config().transfer.mooncake_protocol == "tcp"
    assert config(env="tcp").sglang.mooncake_protocol == "tcp"
    assert config("--sglang-mooncake-protocol", "tcp", env="rdma").sglang.mooncake_protocol == "tcp"
    with pytest.raises(SystemExit, match=r"--host 0\.0\.0\.0"):
        config("--advertise-host", "10.0.0.5")
    assert config("--host", "0.0.0.0", "--advertise-host", "10.0.0.5").transfer.advertise_host == "10.0.0.5"
    assert config("--advertise-host", "localhost").transfer.advertise_host == "localhost"
