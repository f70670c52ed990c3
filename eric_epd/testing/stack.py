"""Subprocess launchers for the rest of a local EPD stack (vLLM serve, the gateway), shared by tests, benchmarks
and the main-job demo. Eric's own launcher is eric_epd.testing.server.EricServer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eric_epd.testing.server import ServerProcess, free_port, new_key


def eric_ec_config(eric_urls: list[str], backends: tuple[str, ...] = ("shm", "http")) -> dict:
    """The --ec-transfer-config that puts vLLM behind Eric."""
    return {"ec_connector": "EricECConnector", "ec_role": "ec_consumer", "ec_buffer_device": "cpu",
            "ec_connector_extra_config": {"eric_urls": eric_urls, "backends": list(backends)}}


class VllmServe(ServerProcess):
    """`vllm serve` on a small local model; with eric_urls, behind Eric (connector + guard middleware, the Erics'
    key in ERIC_API_KEY). vLLM checks its own generated key (VLLM_API_KEY), which the gateway sends."""

    def __init__(self, model: Path, log_path: Path | None = None, eric_urls: list[str] | None = None,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None, dtype: str = "float32",
                 max_model_len: int = 4096, eric_api_key: str | None = None, api_key: str | None = None) -> None:
        port = free_port()
        api_key = api_key or new_key()
        vllm = str(Path(sys.executable).parent / "vllm")
        cmd = [vllm, "serve", str(model), "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
               "--gpu-memory-utilization", "0.15", "--enforce-eager",
               "--limit-mm-per-prompt", json.dumps({"image": 4, "video": 1}), *extra]
        if eric_urls:
            cmd += ["--enable-mm-embeds", "--ec-transfer-config", json.dumps(eric_ec_config(eric_urls)),
                    "--middleware", "eric_epd.plugins.vllm.middleware.refuse_unkeyed_metadata"]
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "VLLM_API_KEY": api_key,
               **({"ERIC_API_KEY": eric_api_key} if eric_api_key else {}), **(env or {})}
        super().__init__(cmd, port, log_path, startup_timeout_s=300, env=env, api_key=api_key)


def pd_vllm(model: Path, role: str, core: int, log_path: Path | None, eric_urls: list[str],
            eric_api_key: str | None = None, api_key: str | None = None) -> VllmServe:
    """One half of a vLLM prefill/decode pair over NIXL with CPU buffers, pinned to its own core (unpinned, both
    bind the same cores and NIXL's 5 s handshake times out). Give both halves the same api_key."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return VllmServe(model, log_path, eric_urls, extra=("--kv-transfer-config", json.dumps(kv)), env=env,
                     eric_api_key=eric_api_key, api_key=api_key)


class GatewayServer(ServerProcess):
    """The gateway; the Erics' and the engines' keys reach it by environment (ERIC_API_KEY, VLLM_API_KEY)."""

    def __init__(self, log_path: Path | None, *args: str, eric_api_key: str | None = None,
                 upstream_api_key: str | None = None) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "epd_gateway", "--port", str(port), "--allowed-host", "127.0.0.1",
               "--health-interval", "0.5", *args]
        env = {k: v for k, v in (("ERIC_API_KEY", eric_api_key), ("VLLM_API_KEY", upstream_api_key)) if v}
        super().__init__(cmd, port, log_path, startup_timeout_s=60, env=env)


def image_messages(urls: list[str], text: str = "Describe what you see.") -> list[dict]:
    """One user turn with these image URLs, then the text."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ask(base_url: str, msgs: list[dict], key: str = "unused", max_tokens: int = 10, **kw):  # -> ChatCompletion
    """A greedy chat completion through the official openai client (EOS ignored: fixed length)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0,
                                          extra_body={"ignore_eos": True}, **kw)


def gateway_paths(gateway_url: str) -> dict[str, float]:
    """gateway_requests_total by path (epd, pd, fallback)."""
    import re

    import httpx

    text = httpx.get(gateway_url + "/metrics").text
    pattern = r'^gateway_requests_total\{path="(\w+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}
