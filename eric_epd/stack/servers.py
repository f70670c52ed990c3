"""Launchers of the local EPD stack's servers as subprocesses (Eric, vLLM serve behind Eric, the gateway, Geri), used by
`eric-epd up`, `eric-epd profile` (LocalServers), the tests, the benchmarks and the demo; each waits until its server
is healthy."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eric_epd.common.cpus import available_cpus, format_cpus, split_cpus
from eric_epd.models.facts import generic_modalities, has_audio_tower
from eric_epd.stack.process import ServerProcess, free_port, new_key


def host_split() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Eric's CPUs, the engine's CPUs): this host's CPUs in two disjoint halves (Eric first; on 2 cores one each),
    so Eric's torch threads and vLLM's OpenMP threads never spin on the same cores."""
    eric, engine = split_cpus(available_cpus(), 2)
    return eric, engine


class EricServer(ServerProcess):
    """`with EricServer(model, tp=2) as eric: httpx.post(eric.url + "/v1/encode", headers=eric.headers, ...)`.
    Its API key is generated unless given (ERIC_API_KEY in its environment); `register_key` (the gateways' admin key,
    for --register-with) goes in EPD_GATEWAY_ADMIN_KEY; it runs on `cpus` (default: Eric's half of host_split())
    with `env` added to its environment. At the end of a `with` block its drain is cut short after `hurry_s`
    (a `stop()` lets it drain)."""

    hurry_s = 2.0

    def __init__(
        self,
        model: Path,
        tp: int = 1,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 180.0,
        api_key: str | None = None,
        cpus: tuple[int, ...] | None = None,
        env: dict[str, str] | None = None,
        register_key: str | None = None,
        media_hosts: tuple[str, ...] = (),
    ) -> None:
        port = port or free_port()
        api_key = api_key or new_key()
        cpus = cpus or host_split()[0]
        cmd = [
            sys.executable,
            "-m",
            "eric_epd",
            "serve",
            "--model",
            str(model),
            "--tp",
            str(tp),
            "--port",
            str(port),
            *allowed_hosts(media_hosts),
            "--cpus",
            format_cpus(cpus),
            *extra_args,
        ]
        keys = {"ERIC_API_KEY": api_key, **({"EPD_GATEWAY_ADMIN_KEY": register_key} if register_key else {})}
        super().__init__(
            cmd, port, log_path, startup_timeout_s, env={**(env or {}), **keys}, api_key=api_key, cpus=cpus
        )


def allowed_hosts(hosts: tuple[str, ...]) -> list[str]:
    """`--allowed-host H` for each media host let past the URL policy. None by default: what users start (`eric-epd
    up`) fetches media only from public addresses; a test serving media on loopback passes ("127.0.0.1",)."""
    return [arg for host in hosts for arg in ("--allowed-host", host)]


def eric_ec_config(
    eric_urls: list[str],
    backends: tuple[str, ...] = ("shm", "http"),
    global_cache: str = "",
    eric_dns: list[str] | None = None,
) -> dict:
    """The --ec-transfer-config that puts vLLM behind Eric (reading the Erics' global cache at that store master);
    `eric_dns` ("NAME:PORT") adds the Erics found by name."""
    extra: dict = {"eric_urls": eric_urls, "backends": list(backends)}
    if eric_dns:
        extra["eric_dns"] = eric_dns
    if global_cache:
        extra["global_cache"] = global_cache
    return {
        "ec_connector": "EricECConnector",
        "ec_role": "ec_consumer",
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": extra,
    }


NO_MEDIA_DOMAIN = "media.eric-epd.invalid"
"""vLLM's --allowed-media-domains: a name that cannot resolve (RFC 6761's .invalid), so vLLM fetches no http(s) URL
at all. The gateway hands engines data: URLs only; this is the second wall, with redirects off too."""


AUDIO_LIMIT = 2
"""Clips a prompt may carry to a model with an audio tower (its thinker's, in the Omni families)."""


def read_config(model: Path) -> dict:
    """`model`'s config.json, or {} where it has none."""
    return json.loads((model / "config.json").read_text()) if (model / "config.json").is_file() else {}


def soundtrack_flags(model: Path) -> tuple[str, ...]:
    """`--trust-request-mm-kwargs` for a model whose videos may carry their soundtrack (the Omni thinkers:
    `use_audio_in_video`, a per-request processor option vLLM refuses without it), else nothing. Only the gateway
    holds the engine's key, and it passes exactly `{"use_audio_in_video": bool}` (router/epd_gateway/content.py)."""
    modalities = generic_modalities(str(read_config(model).get("model_type", "")))
    return ("--trust-request-mm-kwargs",) if {"video", "audio"} <= set(modalities) else ()


def attention_flags(model: Path, dtype: str) -> tuple[str, ...]:
    """`--attention-backend CPU_MLA` for a float32 model with multi-head latent attention (Kimi-K2.5's DeepSeek-V3
    language model) on a host without CUDA: on a CPU with AMX, vLLM 0.32 otherwise picks its AMX MLA kernels, which
    take 16-bit weights only and fail at load; else nothing."""
    config = read_config(model)
    text = config.get("text_config") or config
    if dtype != "float32" or not text.get("kv_lora_rank"):
        return ()
    import torch

    return () if torch.cuda.is_available() else ("--attention-backend", "CPU_MLA")


def media_limits(model: Path) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt for `model`: 4 images and a video, or 5 of a model's single modality for both
    (vLLM turns Kimi-K2.5's image and video parts into "vision_chunk" items: `use_unified_vision_chunk`); and
    AUDIO_LIMIT clips where its config has an audio tower (and as many videos where its videos bring their
    soundtracks: soundtrack_flags)."""
    config = read_config(model)
    audio = {"audio": AUDIO_LIMIT} if has_audio_tower(config) else {}
    if config.get("use_unified_vision_chunk"):
        return {"vision_chunk": 5, **audio}
    return {"image": 4, "video": AUDIO_LIMIT if soundtrack_flags(model) else 1, **audio}


class VllmServe(ServerProcess):
    """`vllm serve` on a small local model, listening on loopback only; with eric_urls, behind Eric (connector +
    guard middleware, the Erics' key in ERIC_API_KEY); `eric_dns` ("NAME:PORT") trusts the Erics a name lists too.
    Every route but /health and /metrics needs its generated key (VLLM_API_KEY, which the gateway sends;
    RequireEngineKey). It runs on `cpus` (default: the engine's half of host_split()), its OpenMP threads bound to
    them; `wrap` is put before its command (e.g. a private mount namespace: tests/gateway/test_dns_members.py);
    `kv_cache_bytes` sizes its KV cache (None: VLLM_CPU_KVCACHE_SPACE GiB, 1 unless set)."""

    private_tmp = True  # its ipc sockets (/tmp/<uuid>), which a killed vLLM leaves behind

    def __init__(
        self,
        model: Path,
        log_path: Path | None = None,
        eric_urls: list[str] | None = None,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        dtype: str = "float32",
        max_model_len: int = 4096,
        eric_api_key: str | None = None,
        api_key: str | None = None,
        cpus: tuple[int, ...] | None = None,
        port: int | None = None,
        global_cache: str = "",
        eric_dns: list[str] | None = None,
        wrap: tuple[str, ...] = (),
        start_cpus: tuple[int, ...] | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        port = port or free_port()
        cpus = cpus or host_split()[1]
        api_key = api_key or new_key()
        vllm = str(Path(sys.executable).parent / "vllm")
        cmd = [
            *wrap,
            vllm,
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--gpu-memory-utilization",
            "0.15",
            "--enforce-eager",
            "--middleware",
            "eric_epd.plugins.vllm.auth.RequireEngineKey",
            "--allowed-media-domains",
            NO_MEDIA_DOMAIN,
            "--limit-mm-per-prompt",
            json.dumps(media_limits(model)),
            *soundtrack_flags(model),
            *attention_flags(model, dtype),
            *extra,
        ]
        if kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if eric_urls or eric_dns:
            ec = eric_ec_config(eric_urls or [], global_cache=global_cache, eric_dns=eric_dns)
            cmd += [
                "--enable-mm-embeds",
                "--ec-transfer-config",
                json.dumps(ec),
                "--middleware",
                "eric_epd.plugins.vllm.middleware.RefuseUnkeyedMetadata",
            ]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": None if kv_cache_bytes else os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_API_KEY": api_key,
            "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
            "VLLM_CPU_OMP_THREADS_BIND": format_cpus(cpus),
            **({"ERIC_API_KEY": eric_api_key} if eric_api_key else {}),
            **(env or {}),
        }
        super().__init__(cmd, port, log_path, 300, env, api_key, cpus, start_cpus)


def pd_vllm(
    model: Path,
    role: str,
    core: int,
    log_path: Path | None,
    eric_urls: list[str],
    eric_api_key: str | None = None,
    api_key: str | None = None,
) -> VllmServe:
    """One half of a vLLM prefill/decode pair over NIXL with CPU buffers, pinned to `core` once started (unpinned,
    both bind the same cores and NIXL's 5 s handshake times out) and starting on any (the halves' serial start-ups
    overlap). Give both halves the same api_key."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return VllmServe(
        model,
        log_path,
        eric_urls,
        extra=("--kv-transfer-config", json.dumps(kv)),
        env=env,
        eric_api_key=eric_api_key,
        api_key=api_key,
        cpus=(core,),
        start_cpus=tuple(sorted(os.sched_getaffinity(0))),
        kv_cache_bytes=64 << 20,  # NIXL registers it page by page (1 GiB took 13-60 s); the tiny models need 4 MiB
    )


class GatewayServer(ServerProcess):
    """The gateway; its keys and the Erics', the engines' and the Geris' reach it by environment (EPD_GATEWAY_API_KEY,
    EPD_GATEWAY_ADMIN_KEY, EPD_GATEWAY_METRICS_KEY (generated unless given), ERIC_API_KEY, VLLM_API_KEY,
    GERI_API_KEY), never on its command line; `wrap` is put
    before its command (e.g. a private mount namespace: tests/gateway/test_dns_members.py)."""

    def __init__(
        self,
        log_path: Path | None,
        *args: str,
        eric_api_key: str | None = None,
        upstream_api_key: str | None = None,
        api_key: str | None = None,
        port: int | None = None,
        cpus: tuple[int, ...] | None = None,
        geri_api_key: str | None = None,
        admin_key: str | None = None,
        wrap: tuple[str, ...] = (),
        metrics_key: str | None = None,
        media_hosts: tuple[str, ...] = (),
    ) -> None:
        port = port or free_port()
        self.metrics_key = metrics_key or new_key()
        cmd = [
            *wrap,
            sys.executable,
            "-m",
            "epd_gateway",
            "--port",
            str(port),
            *allowed_hosts(media_hosts),
            "--health-interval",
            "0.5",
            *args,
        ]
        env = {
            k: v
            for k, v in (
                ("ERIC_API_KEY", eric_api_key),
                ("VLLM_API_KEY", upstream_api_key),
                ("EPD_GATEWAY_API_KEY", api_key),
                ("GERI_API_KEY", geri_api_key),
                ("EPD_GATEWAY_ADMIN_KEY", admin_key),
                ("EPD_GATEWAY_METRICS_KEY", self.metrics_key),
            )
            if v
        }
        super().__init__(
            cmd, port, log_path, startup_timeout_s=60, env=env, api_key=api_key, cpus=cpus or host_split()[0]
        )

    @property
    def metrics_headers(self) -> dict[str, str]:
        """What a scraper sends to read /metrics."""
        return {"Authorization": f"Bearer {self.metrics_key}"}


class GeriServer(ServerProcess):
    """`with GeriServer(tp=2) as geri: httpx.post(geri.url + "/v1/generate", headers=geri.headers, json=body)`; the
    built-in tiny Qwen-Image unless `model` is given. Its API key is generated unless given (GERI_API_KEY); `env` is
    added to its environment."""

    def __init__(
        self,
        model: Path | None = None,
        tp: int = 1,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        log_path: Path | None = None,
        api_key: str | None = None,
        cpus: tuple[int, ...] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        port = port or free_port()
        api_key = api_key or new_key()
        cpus = cpus or host_split()[0]
        cmd = [
            sys.executable,
            "-m",
            "eric_epd",
            "geri",
            "--tp",
            str(tp),
            "--port",
            str(port),
            "--cpus",
            format_cpus(cpus),
            *(("--model", str(model)) if model else ()),
            *extra_args,
        ]
        super().__init__(
            cmd, port, log_path, 180, env={**(env or {}), "GERI_API_KEY": api_key}, api_key=api_key, cpus=cpus
        )


class StoreMaster(ServerProcess):
    """Mooncake Store's master (from the mooncake wheel) for the Erics' --global-cache; `address` is what they are
    given. Healthy once its metrics endpoint answers."""

    health_path = "/metrics"

    def __init__(self, log_path: Path | None = None, cpus: tuple[int, ...] | None = None) -> None:
        rpc, metrics = free_port(), free_port()
        cmd = [
            str(Path(sys.executable).parent / "mooncake_master"),
            f"--rpc_port={rpc}",
            "--enable_http_metadata_server=false",
            f"--metrics_port={metrics}",
        ]
        super().__init__(cmd, metrics, log_path, 60, cpus=cpus or host_split()[0])
        self.address = f"127.0.0.1:{rpc}"


class LocalServers:
    """The profiler's Servers (planning/servers.py) as subprocesses on this host: EricServer and a VllmServe with no
    Eric behind it, each on the share it is given."""

    def eric(
        self,
        model: Path,
        *,
        tp: int,
        cpus: tuple[int, ...] | None,
        env: dict[str, str],
        log_path: Path,
        extra_args: tuple[str, ...],
    ) -> EricServer:
        """An EricServer, started on entering its `with` block."""
        return EricServer(model, tp=tp, cpus=cpus, env=env, log_path=log_path, extra_args=extra_args)

    def engine(
        self,
        model: Path,
        *,
        cpus: tuple[int, ...] | None,
        env: dict[str, str],
        log_path: Path,
        extra_args: tuple[str, ...],
        dtype: str,
        max_model_len: int,
    ) -> VllmServe:
        """A VllmServe, started on entering its `with` block."""
        return VllmServe(
            model, log_path, extra=extra_args, env=env, dtype=dtype, max_model_len=max_model_len, cpus=cpus
        )
