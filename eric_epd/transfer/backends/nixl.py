"""NIXL (UCX) backend: Eric registers its pool as DRAM with one agent; consumers pull bytes with one-sided READs."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import torch

from eric_epd.common.http import bearer
from eric_epd.common.net import interface_of
from eric_epd.transfer.backends.base import TransferError
from eric_epd.wire.handles import EmbeddingHandle, NixlLocation

logger = logging.getLogger(__name__)

_PROGRESS_POLL_US = 100_000
"""poll() timeout of the producer's progress thread; it still wakes at once on every UCX event."""
_POLL_MIN_S, _POLL_MAX_S = 2e-5, 1e-3
"""Backoff between check_xfer_state calls (only network transports get there: CMA completes in the post)."""


def _ucx_settings(net_devices: str = "") -> dict[str, str]:
    """UCX variables for one NIXL agent, set only while it is created (UCX reads them then), so no other UCX user
    of the process (vLLM's own NIXL KV connector, say) and no child process sees them.

    UCX_MODULES=^ib on a host with no RDMA device (unless the user set UCX_MODULES): nixl's wheel bundles its own
    rdma-core and libnl; its libibverbs still dlopens the system's verbs providers, which pull in the system's
    libnl-route too, and the two copies crash in their exit-time destructors (SIGSEGV in rtnl_tc_unregister,
    measured here whenever apt's ibverbs-providers is installed). Without an RDMA device the ib modules have nothing
    to offer; with one, nothing changes. UCX_NET_DEVICES: the interfaces a producer listens on (listen_devices).
    """
    settings = {}
    if "UCX_MODULES" not in os.environ and not _rdma_devices():
        settings["UCX_MODULES"] = "^ib"
    if net_devices:
        settings["UCX_NET_DEVICES"] = net_devices
    return settings


@contextlib.contextmanager
def _scoped_env(settings: dict[str, str]) -> Iterator[None]:
    """These environment variables set for the duration of the block, then restored as they were."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rdma_devices() -> list[str]:
    try:
        return os.listdir("/sys/class/infiniband")
    except OSError:
        return []


def listen_devices(host: str) -> str:
    """UCX network devices for a producer advertised at `host`: the one interface carrying that address, so UCX
    listens there only (by default it listens on every interface). On a host with RDMA devices, or when the
    address is on no local interface, UCX keeps its default (set UCX_NET_DEVICES by hand there)."""
    if _rdma_devices() or "UCX_NET_DEVICES" in os.environ:
        return ""
    return interface_of(host) or ""


def _new_agent(name: str, progress_thread: bool, net_devices: str = "") -> Any:
    """A nixl_agent with one UCX backend and NIXL's own locking off (callers serialize), its UCX settings scoped to
    its creation (_ucx_settings).

    The stock wrapper hard-codes pthrDelay=0, whose progress thread busy-polls a whole core; with a progress
    thread the core agent is rebuilt here with an event-driven 100 ms poll timeout before the backend exists.
    """
    settings = _ucx_settings(net_devices)
    if settings:
        logger.info("NIXL agent %s: UCX created with %s", name, settings)
    with _scoped_env(settings):
        return _create_agent(name, progress_thread)


def _create_agent(name: str, progress_thread: bool) -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixlBind
    except ImportError as e:
        raise TransferError(f"nixl: cannot import nixl ({e})") from e
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        if progress_thread:
            cfg = nixlBind.nixlAgentConfig()
            cfg.useProgThread, cfg.useListenThread, cfg.pthrDelay = True, False, _PROGRESS_POLL_US
            cfg.syncMode, cfg.captureTelemetry = nixlBind.NIXL_THREAD_SYNC_NONE, False
            agent.agent = nixlBind.nixlAgent(name, cfg)
        agent.create_backend("UCX")
    except Exception as e:
        raise TransferError(f"nixl: cannot create agent {name!r} with a UCX backend: {_cause(e)}") from e
    return agent


def _memory_kind(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id for a tensor's storage."""
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class NixlProducer:
    """Inside Eric: one agent over the whole pool, read one-sidedly (an idle-cheap progress thread serves TCP peers)."""

    name = "nixl"

    def __init__(self, agent_name: str, metadata_url: str, advertise_host: str = "") -> None:
        self.agent_name = agent_name
        self.metadata_url = metadata_url
        self._lock = threading.Lock()  # every call on the agent
        # the backend's ucx_devices parameter leaves UCX's listener on every interface; UCX_NET_DEVICES does not
        devices = listen_devices(advertise_host) if advertise_host else ""
        # a progress thread serves TCP peers; CMA needs nothing
        self._agent: Any = _new_agent(agent_name, progress_thread=True, net_devices=devices)
        self._reg: Any = None
        self._base = 0
        self._nbytes = 0

    def register(self, base_addr: int, nbytes: int) -> None:
        """`ProducerBackend` hook: register the pool with the agent as DRAM, once."""
        with self._lock:
            if self._agent is None:
                raise TransferError(f"nixl: producer {self.agent_name!r} is closed")
            if self._reg is not None:
                raise TransferError(f"nixl: producer {self.agent_name!r} already registered its pool")
            try:
                self._reg = self._agent.register_memory([(base_addr, nbytes, 0, "")], "DRAM")
            except Exception as e:
                raise TransferError(f"nixl: agent {self.agent_name!r} cannot register the pool: {_cause(e)}") from e
            self._base, self._nbytes = base_addr, nbytes
        logger.info("nixl agent %s registered pool %#x+%d", self.agent_name, base_addr, nbytes)

    def location(self, offset: int) -> NixlLocation:
        """`ProducerBackend` hook: the agent's name, the address of pool `offset` and where its metadata is served."""
        if self._reg is None:
            raise TransferError(f"nixl: producer {self.agent_name!r} has no registered pool")
        if not 0 <= offset < self._nbytes:
            raise ValueError(f"offset {offset} outside the pool of {self._nbytes} bytes")
        return NixlLocation(agent=self.agent_name, addr=self._base + offset, metadata_url=self.metadata_url)

    def metadata(self) -> bytes:
        """The agent's metadata (connection info and the pool's registration); served at metadata_url."""
        with self._lock:
            if self._agent is None:
                raise TransferError(f"nixl: producer {self.agent_name!r} is closed")
            return bytes(self._agent.get_agent_metadata())

    def close(self) -> None:
        """`ProducerBackend` hook: deregister the pool and drop the agent."""
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            if self._reg is not None:
                try:
                    agent.deregister_memory(self._reg)
                except Exception as e:
                    logger.warning("nixl agent %s: deregistering the pool failed: %s", self.agent_name, _cause(e))
            self._reg = None
        del agent  # the core agent's destructor stops the progress thread and closes the endpoints
        logger.info("nixl agent %s closed", self.agent_name)


class NixlConsumer:
    """In an engine worker: one agent; READs straight into the caller's buffer (registered per call).

    Thread-safe: NIXL calls are serialized by one lock (measured: no faster in parallel on a 2-core host, the
    copy is memory-bound), waits are not, so a stalled producer delays no other read. A read that does not
    finish within `transfer_timeout_s` is cancelled and raises TransferError.
    """

    name = "nixl"

    def __init__(
        self,
        agent_name: str | None = None,
        metadata_timeout_s: float = 5.0,
        transfer_timeout_s: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        self._headers = bearer(api_key)  # the producer's metadata route is behind its API key
        self.agent_name = agent_name or f"eric-consumer-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.metadata_timeout_s = metadata_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._api = threading.Lock()  # every call on the agent (built without NIXL's own locking)
        self._state = threading.Lock()  # _remotes, _connecting, _loads
        self._remotes: dict[str, tuple[str, int]] = {}  # loaded producer agent -> (its metadata_url, load number)
        self._loads = 0
        self._destinations: list[tuple[int, int, str, int, Any]] = []  # (addr, bytes, mem, device, registration)
        self._connecting: dict[str, threading.Lock] = {}
        self._agent: Any = _new_agent(self.agent_name, progress_thread=False)  # our polls progress UCX

    def register_destination(self, dst: torch.Tensor) -> None:
        """Register a long-lived destination (a consumer's landing area: VRAM on CUDA, DRAM on CPU) once; reads
        into it then skip the per-read registration (slow for GPU memory)."""
        mem, dev = _memory_kind(dst)
        addr, n = dst.data_ptr(), dst.numel() * dst.element_size()
        with self._api:
            reg = self._live_agent().register_memory([(addr, n, dev, "")], mem)
        with self._state:
            self._destinations.append((addr, n, mem, dev, reg))
        logger.info(
            "nixl consumer %s registered a %s destination of %d bytes on device %d", self.agent_name, mem, n, dev
        )

    def read(self, handle: EmbeddingHandle, dst: np.ndarray) -> None:
        """`ConsumerBackend` hook: a one-sided READ of the entry into the host array `dst`."""
        if not (
            isinstance(dst, np.ndarray)
            and dst.dtype == np.uint8
            and dst.flags.c_contiguous
            and dst.flags.writeable
            and dst.size == handle.nbytes
        ):
            raise ValueError(f"dst must be a writeable C-contiguous uint8 array of {handle.nbytes} bytes")
        self._read_at(handle, dst.ctypes.data, "DRAM", 0)

    def read_tensor(self, handle: EmbeddingHandle, dst: torch.Tensor) -> None:
        """READ straight into a contiguous tensor of handle.nbytes bytes on any device (GPU memory included)."""
        if not dst.is_contiguous() or dst.numel() * dst.element_size() != handle.nbytes:
            raise ValueError(f"dst must be a contiguous tensor of {handle.nbytes} bytes")
        self._read_at(handle, dst.data_ptr(), *_memory_kind(dst))

    def _registered(self, addr: int, n: int, mem: str, dev: int) -> bool:
        with self._state:
            return any(
                mem == m and dev == d and a <= addr and addr + n <= a + size for a, size, m, d, _ in self._destinations
            )

    def _read_at(self, handle: EmbeddingHandle, addr: int, mem: str, dev: int) -> None:
        loc, n = handle.nixl, handle.nbytes
        if loc is None:
            raise TransferError(f"nixl: embedding {handle.hash} has no NIXL location")
        if n == 0:
            return
        load = self._connect(loc)
        reg, xfer, stage = None, None, "registering dst"
        try:
            with self._api:
                agent = self._live_agent()
                if not self._registered(addr, n, mem, dev):
                    reg = agent.register_memory([(addr, n, dev, "")], mem)
                stage = "creating the request (is the range inside the producer's registered pool?)"
                xfer = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs([(addr, n, dev)], mem),
                    agent.get_xfer_descs([(loc.addr, n, 0)], "DRAM"),
                    loc.agent,
                )
                stage = "posting"
                state = agent.transfer(xfer)
            stage = "waiting"
            deadline, pause = time.monotonic() + self.transfer_timeout_s, _POLL_MIN_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done after {self.transfer_timeout_s:g} s")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
                with self._api:
                    state = self._live_agent().check_xfer_state(xfer)
            if state != "DONE":
                raise RuntimeError(f"transfer state {state}")
        except Exception as e:
            self._cleanup(xfer, reg, failed=(loc.agent, load))
            what = f"nixl: READ of {n} bytes at {loc.addr:#x} from agent {loc.agent!r}"
            raise TransferError(f"{what} failed while {stage}: {_cause(e)}") from e
        self._cleanup(xfer, reg, failed=None)

    def close(self) -> None:
        """`ConsumerBackend` hook: forget the remote agents, deregister the destinations and drop the agent."""
        with self._api:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            with self._state:
                remotes = list(self._remotes)
                destinations, self._destinations = self._destinations, []
            for name in remotes:
                self._forget(agent, name, None)
            for *_, reg in destinations:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    logger.warning("nixl: deregistering a destination failed: %s", _cause(e))
        del agent
        logger.info("nixl consumer agent %s closed", self.agent_name)

    def _live_agent(self) -> Any:
        if self._agent is None:
            raise TransferError(f"nixl: consumer {self.agent_name!r} is closed")
        return self._agent

    def _connect(self, loc: NixlLocation) -> int:
        """Load the producer's metadata on first use (one fetch per agent however many threads ask)."""
        with self._state:
            if loc.agent in self._remotes:
                return self._remotes[loc.agent][1]
            lock = self._connecting.setdefault(loc.agent, threading.Lock())
        with lock:
            with self._state:
                if loc.agent in self._remotes:
                    return self._remotes[loc.agent][1]
            try:
                r = httpx.get(loc.metadata_url, timeout=self.metadata_timeout_s, headers=self._headers)
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise TransferError(
                    f"nixl: metadata of agent {loc.agent!r} from {loc.metadata_url}: {_cause(e)}"
                ) from e
            with self._api:
                agent = self._live_agent()
                try:
                    loaded = agent.add_remote_agent(r.content)  # idempotent for the same metadata
                except Exception as e:
                    raise TransferError(
                        f"nixl: cannot load metadata of agent {loc.agent!r} from {loc.metadata_url}: {_cause(e)}"
                    ) from e
                name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
                with self._state:  # an agent loaded before from this URL belongs to a producer that restarted
                    stale = [a for a, (url, _) in self._remotes.items() if url == loc.metadata_url and a != name]
                    self._loads += 1
                    self._remotes[name] = (loc.metadata_url, self._loads)
                    load = self._loads
                for a in stale:
                    self._forget(agent, a, None)
            logger.info("nixl: loaded remote agent %s from %s", name, loc.metadata_url)
        if name != loc.agent:
            raise TransferError(
                f"nixl: handle is for agent {loc.agent!r} but {loc.metadata_url} now serves {name!r}"
                " (the producer restarted; the embedding is gone)"
            )
        return load

    def _forget(self, agent: Any, name: str, load: int | None) -> None:
        """Unload a remote agent (closing its endpoint) unless it was reloaded since `load`; holds self._api."""
        with self._state:
            if name not in self._remotes or load not in (None, self._remotes[name][1]):
                return
            del self._remotes[name]
        try:
            agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("nixl: removing remote agent %s: %s", name, _cause(e))
        logger.info("nixl: dropped remote agent %s", name)

    def _cleanup(self, xfer: Any, reg: Any, failed: tuple[str, int] | None) -> None:
        """Release the request (cancels it if active); after a failure drop the remote agent so the next read
        re-fetches its metadata (closing the endpoint also aborts whatever UCX still has in flight); unregister dst."""
        with self._api:
            agent = self._agent
            if agent is None:
                return
            if xfer is not None:
                try:
                    agent.release_xfer_handle(xfer)
                except Exception as e:
                    logger.warning("nixl: releasing a transfer request failed: %s", _cause(e))
            if failed is not None:
                self._forget(agent, *failed)
            if reg is not None:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    logger.warning("nixl: deregistering a destination buffer failed: %s", _cause(e))
