"""Eric-side writers for SGLang's push transfers (mooncake, NIXL): Eric writes a part from its pool into a prefill
rank's registered landing buffer, with engines of its own that register the pool once, on first use."""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from typing import Any

from eric_epd.wire.sglang import NixlSession

logger = logging.getLogger(__name__)


class PushError(Exception):
    """A write into a prefill rank's buffer failed; the message names the peer and the cause."""


def _probe(session_id: str, timeout_s: float) -> None:
    """TCP-connect to a Mooncake session (host:rpc_port) first: the engine opens unknown sessions under a global
    lock and blocks about a minute on an unreachable peer."""
    host, _, port = session_id.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise PushError(f"mooncake session {session_id} is unreachable: {e}") from e


class MooncakePusher:
    """One TransferEngine (P2P handshake) with Eric's pool registered; writes are batch_transfer_sync_write."""

    def __init__(self, host: str, protocol: str, device: str, base_addr: int, nbytes: int) -> None:
        from mooncake.engine import TransferEngine  # optional dependency: only when a prefill uses mooncake

        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise PushError(f"mooncake: initialize(host={host!r}, protocol={protocol!r}) rc={rc}")
        rc = self._engine.register_memory(base_addr, nbytes)
        if rc != 0:
            raise PushError(f"mooncake: register_memory of the {nbytes}-byte pool rc={rc}")
        self._base = base_addr
        self._opened: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        logger.info("SGLang adapter: mooncake push engine on %s (%s)", host, protocol)

    def write(self, session_id: str, srcs: list[int], dsts: list[int], lens: list[int], timeout_s: float) -> None:
        """Blocking; call from a worker thread."""
        with self._lock:
            known = session_id in self._opened
        if not known:
            _probe(session_id, timeout_s)
        rc = self._engine.batch_transfer_sync_write(session_id, srcs, dsts, lens)
        if rc < 0:
            with self._lock:
                self._opened.pop(session_id, None)
            raise PushError(f"mooncake write of {sum(lens)} bytes to session {session_id} failed (rc={rc})")
        with self._lock:
            self._opened[session_id] = None
            while len(self._opened) > 1024:
                self._opened.popitem(last=False)

    def close(self) -> None:
        """Unregister the pool from the Mooncake engine."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base)


class NixlPusher:
    """One NIXL agent (UCX) with Eric's pool registered as DRAM; WRITEs into the landing buffers a prefill rank
    described in its session (agent metadata + memory type). Calls on the agent are serialized."""

    def __init__(self, agent_name: str, base_addr: int, nbytes: int) -> None:
        from eric_epd.transfer.backends.nixl import _new_agent  # Eric's agent factory (UCX, NIXL locking off)

        self.agent_name = agent_name
        self._lock = threading.Lock()
        self._agent: Any = _new_agent(agent_name, progress_thread=False)  # we poll our own requests
        self._reg = self._agent.register_memory([(base_addr, nbytes, 0, "")], "DRAM")
        self._base = base_addr
        self._loaded: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # metadata -> agent name
        logger.info("SGLang adapter: nixl push agent %s", agent_name)

    def _remote(self, metadata: bytes) -> str:
        """Load (or refresh: re-adding an agent with newer metadata updates it) the rank's agent; holds the lock."""
        name = self._loaded.get(metadata)
        if name is None:
            loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._loaded[metadata] = name
            while len(self._loaded) > 256:
                self._loaded.popitem(last=False)
        return name

    def write(self, session: NixlSession, srcs: list[int], dsts: list[int], lens: list[int], timeout_s: float) -> None:
        """Blocking; call from a worker thread."""
        xfer, name = None, "?"
        try:
            with self._lock:
                name = self._remote(session.agent_metadata)
                xfer = self._agent.initialize_xfer(
                    "WRITE",
                    self._agent.get_xfer_descs([(s, n, 0) for s, n in zip(srcs, lens)], "DRAM"),
                    self._agent.get_xfer_descs([(d, n, session.device) for d, n in zip(dsts, lens)], session.mem_type),
                    name,
                )
                state = self._agent.transfer(xfer)
            deadline, pause = time.monotonic() + timeout_s, 2e-5
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done after {timeout_s:g} s")
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
                with self._lock:
                    state = self._agent.check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        except Exception as e:
            with self._lock:
                self._loaded = collections.OrderedDict((m, a) for m, a in self._loaded.items() if a != name)
            raise PushError(f"nixl WRITE of {sum(lens)} bytes to agent {name!r} failed: {type(e).__name__}: {e}") from e
        finally:
            if xfer is not None:
                with self._lock:
                    try:
                        self._agent.release_xfer_handle(xfer)
                    except Exception as e:
                        logger.warning("nixl: releasing a transfer request failed: %s", e)

    def close(self) -> None:
        """Deregister the pool and drop the NIXL agent."""
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is not None:
                try:
                    agent.deregister_memory(self._reg)
                except Exception as e:
                    logger.warning("nixl: deregistering the pool failed: %s", e)
        del agent
