"""SGLang plugin (entry point group `sglang.srt.plugins`): NIXL as the encoder transfer on SGLang's prefill side,
through SGLang's hook registry and resolution hooks (no SGLang file is patched)."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import uuid
from typing import Any

from eric_epd.wire.sglang import NixlSession, encode_nixl_session

logger = logging.getLogger(__name__)

ENV = "ERIC_SGLANG_ENCODER_TRANSFER"
"""Set to "nixl" (by --encoder-transfer-backend nixl, or by hand next to --encoder-transfer-backend mooncake)."""
BACKEND = "nixl"

_in_receiver_init: contextvars.ContextVar[bool] = contextvars.ContextVar("eric_sglang_receiver_init", default=False)
_engine: NixlLandingEngine | None = None
_engine_lock = threading.Lock()
_registered = False


def nixl_selected() -> bool:
    """Whether ERIC_SGLANG_ENCODER_TRANSFER selects NIXL for this process."""
    return os.environ.get(ENV, "").strip().lower() == BACKEND


class NixlLandingEngine:
    """What SGLang's encoder receiver holds as `embeddings_engine` when NIXL is selected: a NIXL agent (UCX) whose
    registered landing buffers Eric WRITEs into. Its `session_id` carries the agent metadata (a few hundred bytes),
    so no side channel is needed. The agent runs a progress thread: WRITE targets must progress on TCP."""

    def __init__(self, hostname: str, gpu_id: int | None = None) -> None:
        import torch

        self.hostname = hostname
        self.gpu_id = gpu_id
        self.mem_type = "VRAM" if torch.cuda.is_available() else "DRAM"
        self.agent_name = f"sglang-epd-{hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._agent: Any = None
        self._regs: dict[int, Any] = {}

    def _live(self) -> Any:
        if self._agent is None:
            from eric_epd.transfer.backends.nixl import _new_agent

            self._agent = _new_agent(self.agent_name, progress_thread=True)
            logger.info("NIXL encoder landing agent %s (%s)", self.agent_name, self.mem_type)
        return self._agent

    @property
    def device(self) -> int:
        """The device a landing buffer lives on: SGLang's receiver passes no gpu_id, so the rank's current CUDA
        device (each rank's scheduler process sets its own, `--base-gpu-id` included); 0 for host memory."""
        if self.mem_type != "VRAM":
            return 0
        if self.gpu_id is not None:
            return self.gpu_id
        import torch

        return torch.cuda.current_device()

    def register(self, ptr: int, length: int) -> None:
        """Register a landing buffer with the agent (SGLang's `register(ptr, length)`)."""
        with self._lock:
            try:
                self._regs[ptr] = self._live().register_memory([(ptr, length, self.device, "")], self.mem_type)
            except Exception as e:
                raise RuntimeError(f"NIXL memory registration of {length} bytes failed: {e}") from e

    def deregister(self, ptr: int) -> None:
        """Deregister the landing buffer at `ptr`, if it was registered."""
        with self._lock:
            reg = self._regs.pop(ptr, None)
            if reg is None or self._agent is None:
                return
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                raise RuntimeError(f"NIXL memory deregistration failed: {e}") from e

    @property
    def session_id(self) -> str:
        """The session id Eric writes to: the agent's metadata, memory type and device (`encode_nixl_session`)."""
        with self._lock:
            metadata = bytes(self._live().get_agent_metadata())
        return encode_nixl_session(NixlSession(agent_metadata=metadata, mem_type=self.mem_type, device=self.device))

    def close(self) -> None:
        """Deregister every landing buffer and drop the agent."""
        with self._lock:
            agent, self._agent = self._agent, None
            regs, self._regs = list(self._regs.values()), {}
            for reg in regs:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    logger.warning("NIXL deregistration at close failed: %s", e)
        del agent


def landing_engine(hostname: str, gpu_id: int | None = None) -> NixlLandingEngine:
    """The process's one landing engine (SGLang keeps one Mooncake engine per process the same way)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = NixlLandingEngine(hostname, gpu_id)
        return _engine


# ------------------------------------------------------------------------------------------------------- hooks


def _add_nixl_choice(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    for action in parser._actions:
        if "--encoder-transfer-backend" in action.option_strings and BACKEND not in (action.choices or [BACKEND]):
            action.choices = [*action.choices, BACKEND]
            action.help = (action.help or "") + " 'nixl' (Eric's SGLang plugin): Eric writes over NIXL."
    return None


def _resolve_nixl(server_args: Any, previous: Any) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.encoder_transfer_backend == BACKEND:
        if cfg.encoder_only:
            raise ValueError(
                "--encoder-transfer-backend nixl is served by Eric (eric-epd serve), not by SGLang's "
                "--encoder-only server; use it on the --language-only prefill"
            )
        os.environ[ENV] = BACKEND  # scheduler and tokenizer processes are started after this and inherit it
        declare_resolution(server_args, "eric_epd.plugins.sglang", encoder_transfer_backend="mooncake")
        logger.info("encoder transfer: SGLang's mooncake flow with a NIXL landing engine (Eric plugin)")
    previous(server_args)


def _receiver_init(original: Any, *args: Any, **kwargs: Any) -> Any:
    if not nixl_selected():
        return original(*args, **kwargs)
    token = _in_receiver_init.set(True)
    try:
        return original(*args, **kwargs)
    finally:
        _in_receiver_init.reset(token)


def _get_engine(original: Any, *args: Any, **kwargs: Any) -> Any:
    if _in_receiver_init.get() and nixl_selected():
        return _engine
    return original(*args, **kwargs)


def _init_engine(original: Any, hostname: str, gpu_id: int | None = None, ib_device: str | None = None) -> Any:
    if _in_receiver_init.get() and nixl_selected():
        return landing_engine(hostname, gpu_id)
    return original(hostname, gpu_id=gpu_id, ib_device=ib_device)


def _other_mooncake_users() -> bool:
    """maybe_init_shared_mooncake_transfer_engine's reasons other than encoder disaggregation (SGLang 0.5.23)."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_disagg, get_exec, get_memory

    disagg, memory, moe = get_disagg(), get_memory(), get_exec().moe
    return bool(
        (disagg.disaggregation_mode != "null" and disagg.disaggregation_transfer_backend == "mooncake")
        or (
            memory.enable_hierarchical_cache
            and memory.hicache_storage_backend == "mooncake"
            and envs.SGLANG_HICACHE_MOONCAKE_REUSE_TE.get()
        )
        or (moe.enable_elastic_expert_backup and moe.elastic_ep_backend is not None)
        or moe.elastic_ep_backend == "mooncake"
    )


def _maybe_init_shared(original: Any, *args: Any, **kwargs: Any) -> Any:
    if nixl_selected() and not _other_mooncake_users():
        logger.info("no shared Mooncake engine: the encoder transfer uses NIXL")
        return None
    return original(*args, **kwargs)


HOOK_TARGETS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": ("AFTER", _add_nixl_choice),
    "sglang.srt.disaggregation.encoder.receiver.MMReceiverBase.__init__": ("AROUND", _receiver_init),
    "sglang.srt.distributed.parallel_state.get_mooncake_transfer_engine": ("AROUND", _get_engine),
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.init_mooncake_transfer_engine": (
        "AROUND",
        _init_engine,
    ),
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.maybe_init_shared_mooncake_transfer_engine": (
        "AROUND",
        _maybe_init_shared,
    ),
}
RESOLUTION_STEP = "handle_encoder_disaggregation"


def register() -> None:
    """The `sglang.srt.plugins` entry point: SGLang's load_plugins() calls it in every process, then applies hooks.

    SGLang 0.5.23's mooncake flow is transport-neutral except for one object, the receiver's transfer engine, used
    as ``register(ptr, n)``, ``deregister(ptr)`` and ``session_id`` (which the encoder gets in /send and writes
    to). The hooks keep SGLang's whole flow (tokenizer dispatch, /scheduler_receive_meta_data, landing buffer or
    EmbeddingPool, /send, ZMQ completion, TP status all-reduce) and swap only that engine:

    - ``ServerArgs.add_cli_args`` (HookRegistry, AFTER): ``--encoder-transfer-backend`` also accepts ``nixl``.
    - resolution step ``handle_encoder_disaggregation`` (register_resolution_hook): ``nixl`` resolves to SGLang's
      ``mooncake`` flow and sets ERIC_SGLANG_ENCODER_TRANSFER=nixl, which the scheduler processes inherit.
    - ``MMReceiverBase.__init__``, ``get_mooncake_transfer_engine``, ``init_mooncake_transfer_engine`` (AROUND):
      inside an encoder receiver's construction, and only there, the engine is a `NixlLandingEngine`.
    - ``maybe_init_shared_mooncake_transfer_engine`` (AROUND): no Mooncake engine is started for the encoder alone.

    The encoder side is Eric (eric_epd/eric/sglang/routes.py); SGLang's own --encoder-only server does not speak
    this transfer, so ``--encoder-only --encoder-transfer-backend nixl`` is refused.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (kind, hook) in HOOK_TARGETS.items():
        HookRegistry.register(target, hook, HookType[kind])
    register_resolution_hook(RESOLUTION_STEP)(_resolve_nixl)
    _registered = True
