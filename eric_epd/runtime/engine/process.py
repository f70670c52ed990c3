"""The engine process shell: owns the ZMQ sockets and the busy loop around the socket-free Engine."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import signal
import time
from multiprocessing.connection import Connection

import zmq

from eric_epd.common.heap import keep_freed_heap
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.engine.engine import Engine, Outgoing
from eric_epd.runtime.engine.heartbeat import Heartbeat
from eric_epd.runtime.engine.messages import (
    AbortRequestMsg,
    Op,
    ShutdownMsg,
    WorkRequestMsg,
    decode_frames,
    encode_frames,
)
from eric_epd.runtime.quick_exit import then_exit
from eric_epd.runtime.workload import Workload

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50


class Stragglers:
    """The engine's workers, watched from the router through pidfds (so a reused pid is never signalled): once the
    engine is gone, nothing else stops a worker that is mid-batch from writing into the pool."""

    def __init__(self, pids: list[int]) -> None:
        self._fds: dict[int, int] = {}
        for pid in pids:
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:  # already gone
                pass

    def gone(self) -> bool:
        """Kill every worker still running (SIGKILL, not waiting) and say whether all have exited."""
        for pid, fd in list(self._fds.items()):
            if select.select([fd], [], [], 0)[0]:  # a pidfd reads ready once its process has exited
                os.close(self._fds.pop(pid))
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not self._fds

    def wait_gone(self, timeout_s: float) -> bool:
        """Kill and wait up to `timeout_s` for every worker to exit; whether all did."""
        deadline = time.monotonic() + timeout_s
        while not self.gone() and time.monotonic() < deadline:
            select.select(list(self._fds.values()), [], [], min(0.1, max(0.0, deadline - time.monotonic())))
        return not self._fds


class EngineProcess:
    """Parent-side handle: spawn() starts the engine (and through it the workers) and waits until it is ready."""

    def __init__(self, proc: mp.process.BaseProcess, worker_pids: list[int], heartbeat: Heartbeat) -> None:
        self.proc = proc
        self._workers = Stragglers(worker_pids)
        self._heartbeat = heartbeat

    @classmethod
    def spawn(cls, config: RuntimeConfig, workload: Workload, timeout_s: float = 900.0) -> EngineProcess:
        """Start the engine process and wait up to `timeout_s` for it to be ready; raise with its reason otherwise."""
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        heartbeat = Heartbeat(ctx)
        proc = ctx.Process(
            target=then_exit, args=(main, config, workload, child_end, heartbeat), name="engine", daemon=False
        )
        proc.start()
        child_end.close()
        if not parent_end.poll(timeout_s):
            proc.kill()
            raise TimeoutError(f"engine not ready after {timeout_s}s")
        try:
            status = parent_end.recv()
        except EOFError:
            status = f"engine exited with code {proc.exitcode} before it was ready"
        if not (isinstance(status, tuple) and status[0] == "ready"):
            proc.join(timeout=5)
            raise RuntimeError(status)
        return cls(proc, list(status[1]), heartbeat)

    def is_alive(self) -> bool:
        """True while the engine, or any worker it started, may still run and so write into the pool. Once the
        engine has died its workers are killed, and this turns False only when every one has exited: requests in
        flight fail (and their regions return) only then. Never blocks."""
        return self.proc.is_alive() or not self._workers.gone()

    def heartbeat_age(self) -> float:
        """Seconds since the engine last found its workers alive (its loop, or its wait for a batch); never blocks."""
        return self._heartbeat.age()

    @property
    def pid(self) -> int | None:
        """The engine process's pid."""
        return self.proc.pid

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Wait for the engine to exit after the client sent SHUTDOWN; kill it past the timeout, and any worker it
        left behind. Idempotent."""
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if not self._workers.wait_gone(5.0):
            logger.error("engine workers still running after shutdown")


def main(config: RuntimeConfig, workload: Workload, ready: Connection, heartbeat: Heartbeat) -> None:
    """Child-side entry point."""
    from eric_epd.runtime.executor.executor import ModelExecutor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router owns Ctrl-C and asks us to stop
    keep_freed_heap(config.heap_keep_bytes)
    executor = None
    try:
        executor = ModelExecutor(config, workload, heartbeat.beat)
        executor.wait_ready()
        executor.warm_up()
    except Exception as e:
        logger.exception("engine start failed")
        ready.send(f"engine start failed: {e}")
        if executor is not None:
            executor.shutdown()
        return
    try:
        pids = [w.pid for w in executor.workers()]
        _EngineLoop(config, Engine(config.batch_limits(), executor, workload.validate), ready, pids).run()
    finally:
        executor.shutdown()


class _EngineLoop:
    def __init__(self, config: RuntimeConfig, engine: Engine, ready: Connection, worker_pids: list[int]) -> None:
        self._engine = engine
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PULL)
        self._input.bind(config.engine_input_addr)
        self._output = self._ctx.socket(zmq.PUSH)
        self._output.bind(config.engine_output_addr)
        self._parent = os.getppid()
        ready.send(("ready", worker_pids))  # the router watches them should this process die
        ready.close()

    def run(self) -> None:
        try:
            while os.getppid() == self._parent:
                if not self._drain_input():
                    return
                self._send(self._engine.step())
                if self._engine.has_unreported_batches:
                    self._send_status()
        finally:
            self._input.close(linger=0)
            self._output.close(linger=1000)
            self._ctx.term()

    def _drain_input(self) -> bool:
        """Receive everything waiting; block briefly only when idle. False on SHUTDOWN."""
        timeout = 0 if self._engine.has_work else _IDLE_POLL_MS
        while self._input.poll(timeout):
            timeout = 0
            op, msg, buffers = decode_frames(self._input.recv_multipart(copy=False))
            if op is Op.SHUTDOWN:
                logger.info("engine shutting down: %s", msg.reason if isinstance(msg, ShutdownMsg) else "")
                return False
            if op is Op.STATUS_REQUEST:
                self._send_status()
            elif op is Op.SUBMIT and isinstance(msg, WorkRequestMsg):
                self._send(self._engine.add_request(msg, buffers))
            elif op is Op.ABORT and isinstance(msg, AbortRequestMsg):
                self._send(self._engine.abort(msg))
            else:
                logger.warning("ignoring unexpected message %s", op)
        return True

    def _send(self, outgoing: list[Outgoing]) -> None:
        for msg, buffers in outgoing:
            self._output.send_multipart(encode_frames(Op.RESULT, msg, buffers), copy=False)

    def _send_status(self) -> None:
        self._output.send_multipart(encode_frames(Op.STATUS, self._engine.status()))
