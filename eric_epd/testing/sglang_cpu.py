"""The real `sglang.launch_server` on a CPU-only host, for the tests (`python -m eric_epd.testing.sglang_cpu ARGS`),
with two stand-ins for the GPU it lacks: video frames are not pinned; encoder landing buffers live in host memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from eric_epd.stack.process import ServerProcess, free_port

SGLANG_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-overlap-schedule",
    "--skip-server-warmup",
    "--sleep-on-idle",  # an idle scheduler otherwise polls flat out: a few servers would starve the others' CPUs
    "--mem-fraction-static",
    "0.1",
    "--max-total-tokens",
    "4096",
    "--max-running-requests",
    "2",
    "--chunked-prefill-size",
    "2048",
)
"""SGLang's native torch paths on a CPU. SGLang's own CPU engine (SGLANG_USE_CPU_ENGINE=1) needs `sgl_kernel`'s CPU
build, which PyPI does not carry; without that flag SGLang runs its torch-native attention and samplers on the CPU."""


def unpinned_video_frames() -> None:
    """SGLang's video decoder and Qwen-VL video preprocessing pin frames unless SGLang's CPU engine flag is set
    (which imports `sgl_kernel`); pinning needs an accelerator. Their own CPU-engine branches (no pinning) are
    taken; nothing else reads the flag at request time."""
    from sglang.srt.multimodal.processors import qwen_vl
    from sglang.srt.utils import video_decoder

    video_decoder._is_cpu_engine = lambda: True
    qwen_vl.is_cpu = lambda: True


class _HostLandingTorch:
    """`torch` as SGLang's encoder receiver sees it: `torch.empty(..., device="cuda:N")` (its landing buffers for
    mooncake and NIXL writes) allocates in host memory when no CUDA device exists; everything else is torch."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def empty(self, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is not None and str(device).startswith("cuda") and not self._torch.cuda.is_available():
            device = "cpu"
        return self._torch.empty(*args, device=device, **kwargs)


def _host_landing_buffers() -> None:
    from sglang.srt.disaggregation.encoder import receiver

    if not isinstance(receiver.torch, _HostLandingTorch):
        receiver.torch = _HostLandingTorch(receiver.torch)


def _stand_ins() -> None:
    """Applied in the server's processes: SGLang spawns its scheduler and detokenizer, which import this main
    module as `__mp_main__`."""
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    unpinned_video_frames()
    _host_landing_buffers()


class SglangServe(ServerProcess):
    """A real SGLang server on this CPU (float32, SGLANG_ARGS): `language_only` with `encoder_urls` and a
    `transfer` (`nixl`: through Eric's SGLang plugin) has Eric encode its media;
    otherwise it serves the checkpoint alone, without Eric's SGLang plugin (SGLANG_PLUGINS names no plugin).
    `cpus`: the CPUs it (every process it starts) is pinned to; None: unpinned."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        encoder_urls: tuple[str, ...] = (),
        transfer: str = "zmq_to_scheduler",
        extra_args: tuple[str, ...] = (),
        cpus: tuple[int, ...] | None = None,
    ) -> None:
        port, env = free_port(), {"SGLANG_HOST_IP": "127.0.0.1", "SGLANG_EMBEDDING_POOL_SIZE_MB": "256"}
        cmd = [sys.executable, "-m", __name__, "--model-path", str(model), *SGLANG_ARGS, "--dtype", "float32"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *extra_args]
        if encoder_urls:
            cmd += ["--language-only", "--encoder-urls", *encoder_urls, "--encoder-transfer-backend", transfer]
            cmd += ["--encoder-bootstrap-port", str(free_port())]
        else:
            env["SGLANG_PLUGINS"] = "eric-epd-not-loaded"
        super().__init__(cmd, port, log_path, startup_timeout_s=300, env=env, cpus=cpus)


def main() -> None:
    """What `python -m sglang.launch_server ARGS` does, with this module as the processes' main module."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ in ("__main__", "__mp_main__"):
    _stand_ins()
if __name__ == "__main__":
    main()
