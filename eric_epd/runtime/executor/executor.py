"""ModelExecutor: one worker per TP rank; broadcasts each batch through shared memory, gathers every rank's answer
(rank 0 wrote the outputs into the pool)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections.abc import Callable

import zmq

from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.executor.messages import (
    ExecuteBatchMsg,
    StopWorkerMsg,
    WorkerReadyMsg,
    WorkerResultMsg,
    from_worker_decoder,
    to_worker_encoder,
)
from eric_epd.runtime.executor.shm_broadcast import ShmBroadcast
from eric_epd.runtime.executor.worker import WorkerArgs, main
from eric_epd.runtime.quick_exit import then_exit
from eric_epd.runtime.work import Batch, BatchFailedError, BatchOutput, ItemResult, WorkerInfo, WorkersDeadError
from eric_epd.runtime.workload import Workload

logger = logging.getLogger(__name__)

_POLL_MS = 100
WARMUP_BATCH_ID = -1
TP_ERROR_GRACE_S = 3.0
"""After one rank reports an error, how long the other ranks have to report theirs before the group is dead."""
STOP_GRACE_S = 5.0
"""How long a worker told to stop (SIGTERM) has before it is killed."""


def broadcast_geometry(max_batch_input_bytes: int) -> dict[str, int]:
    """Broadcast slots that hold the largest batch the scheduler forms plus headers, so no batch spills into a fresh
    segment: 4 slots of 32 MiB on CPU; on CUDA, 2 slots of ~155 MB for Qwen2-VL's 32768-patch cap."""
    need = max_batch_input_bytes + (1 << 20)
    slot = max(32 << 20, -(-need // (1 << 20)) * (1 << 20))
    return {"n_slots": 4 if slot <= 32 << 20 else 2, "slot_bytes": slot}


class ModelExecutor:
    """Owns the worker processes. execute_model blocks until rank 0 answers, a worker fails, or a timeout."""

    def __init__(self, config: RuntimeConfig, workload: Workload, beat: Callable[[], None] = lambda: None) -> None:
        self._config = config
        self._beat = beat  # renewed whenever the workers are found alive (every loop and every wait for them)
        self._workload = workload
        self._ctx = zmq.Context.instance()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(config.worker_result_addr)
        self._decoder = from_worker_decoder()
        self._broadcast = ShmBroadcast.create(
            n_readers=config.tp_size,
            wake=config.broadcast_wake_addr,
            **broadcast_geometry(workload.max_batch_input_bytes(config)),
        )
        self._settings: dict[int, tuple[list[int], int]] = {}  # rank -> (cpus, torch threads) it reported
        spawn = mp.get_context("spawn")
        dist_init = f"file://{config.run_dir / 'tp-rendezvous'}"  # in the private ipc directory: no port to race for
        self._procs = [
            spawn.Process(
                target=then_exit,
                args=(main, WorkerArgs(config, workload, rank, self._broadcast.handle(), dist_init)),
                name=f"worker-{rank}",
                daemon=True,
            )
            for rank in range(config.tp_size)
        ]
        for p in self._procs:
            p.start()
        self._dead_reason: str | None = None
        self._submitted: set[int] = set()  # batch ids handed to the workers and not collected yet
        self._early: dict[int, list[WorkerResultMsg]] = {}  # answers to a later batch that came while waiting

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every rank loaded its shard; raise with the worker's own error otherwise."""
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self._procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s}s (ready ranks: {sorted(ready)})")
            reason = self.check_workers()
            if reason is not None:
                raise RuntimeError(reason)
            if not self._results.poll(_POLL_MS):
                continue
            msg = self._decoder.decode(self._results.recv_multipart()[0])
            if isinstance(msg, WorkerReadyMsg):
                if msg.error is not None:
                    raise RuntimeError(f"worker rank {msg.rank} failed to load: {msg.error}")
                ready.add(msg.rank)
                self._settings[msg.rank] = (msg.cpus, msg.threads)
                logger.info("worker rank %d: cpus %s, %d torch threads", msg.rank, msg.cpus, msg.threads)

    def warm_up(self) -> None:
        """The workload's small warm-up item through every rank before the engine says it is ready: the process
        group's first collective (NCCL builds its communicators lazily) and each kernel's first run happen here,
        not on a client's request, and a rank that cannot run fails the start. Nothing is written to the pool."""
        item, data = self._workload.warmup(self._config)
        msg = ExecuteBatchMsg(WARMUP_BATCH_ID, item.kind, [item], warmup=True)
        start = time.perf_counter()
        self._broadcast.enqueue(
            to_worker_encoder.encode(msg),
            [data],
            timeout=self._config.worker_timeout_s,
            should_abort=lambda: self.check_workers() is not None,
        )
        try:
            rank0 = self._gather(WARMUP_BATCH_ID)
        except (BatchFailedError, WorkersDeadError) as e:
            raise RuntimeError(f"warm-up batch failed: {e}") from e
        logger.info(
            "warm-up batch ran on %d rank(s) in %.2fs (output %s)",
            len(self._procs),
            time.perf_counter() - start,
            [list(s) for s in rank0.shapes],
        )

    def workers(self) -> list[WorkerInfo]:
        """`Executor` hook: each rank's worker process, with its CPUs and torch threads once reported."""
        return [WorkerInfo(p.pid or 0, *self._settings.get(rank, ([], 0))) for rank, p in enumerate(self._procs)]

    def check_workers(self) -> str | None:
        """None while every worker lives; otherwise why not (sticky). Once one rank is gone the others are stopped
        before this returns, so rank 0 writes no region after the engine fails the requests in flight."""
        if self._dead_reason is None:
            for rank, p in enumerate(self._procs):
                if not p.is_alive():
                    self._dead_reason = f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    self._stop_workers()
                    break
        if self._dead_reason is None:
            self._beat()
        return self._dead_reason

    def execute_model(self, batch: Batch) -> BatchOutput:
        """Run one batch on all ranks; rank 0 wrote the outputs into the pool. One result per item, in order,
        with rank 0's forward and pool-write times."""
        self.submit(batch)
        return self.collect(batch)

    def submit(self, batch: Batch) -> None:
        """Hand the batch to every rank (they run batches in the order submitted); `collect` waits for it."""
        if (reason := self.check_workers()) is not None:
            raise WorkersDeadError(reason)
        msg = ExecuteBatchMsg(batch.batch_id, batch.kind, [e.item for e in batch.entries])
        try:
            self._broadcast.enqueue(
                to_worker_encoder.encode(msg),
                [e.input for e in batch.entries],
                timeout=self._config.worker_timeout_s,
                should_abort=lambda: self.check_workers() is not None,
            )
        except Exception as e:
            if self.check_workers() is None:  # they live, and may still write earlier batches: stop them first
                self._dead_reason = f"broadcast to workers failed: {e!r}"
                self._stop_workers()
            raise WorkersDeadError(self.check_workers() or "workers stopped") from e
        self._submitted.add(batch.batch_id)

    def collect(self, batch: Batch) -> BatchOutput:
        """Wait for a submitted batch (the oldest not collected yet)."""
        try:
            rank0 = self._gather(batch.batch_id)
        finally:
            self._submitted.discard(batch.batch_id)
            self._early.pop(batch.batch_id, None)
        return BatchOutput(self._split(batch, rank0), rank0.compute_seconds, rank0.write_seconds)

    def _gather(self, batch_id: int) -> WorkerResultMsg:
        """Wait for every rank's answer to batch_id; rank 0 carries the outputs' shapes.

        With TP > 1, once one rank fails the others get TP_ERROR_GRACE_S to answer too (an error every rank hits
        fails only the batch); a rank still silent then is stuck in a collective its failed peer never joined, so
        the workers are declared dead and stopped at once instead of waiting out the worker timeout."""
        deadline = time.monotonic() + self._config.worker_timeout_s
        pending = set(range(len(self._procs)))
        errors: list[str] = []
        rank0: WorkerResultMsg | None = None
        early = self._early.pop(batch_id, [])
        while pending:
            if (reason := self.check_workers()) is not None:
                raise WorkersDeadError(reason)
            if time.monotonic() > deadline:
                self._dead_reason = (
                    f"rank(s) {sorted(pending)} stuck after {'; '.join(errors)}"
                    if errors
                    else f"workers did not finish batch {batch_id} within {self._config.worker_timeout_s}s"
                )
                self._stop_workers()
                raise WorkersDeadError(self._dead_reason)
            if early:
                msg = early.pop(0)
            elif not self._results.poll(_POLL_MS):
                continue
            else:
                msg = self._decoder.decode(self._results.recv())
            if isinstance(msg, WorkerResultMsg) and msg.batch_id != batch_id and msg.batch_id in self._submitted:
                self._early.setdefault(msg.batch_id, []).append(msg)  # a rank already answered the next batch
                continue
            if not isinstance(msg, WorkerResultMsg) or msg.batch_id != batch_id:
                logger.warning("dropping stale worker message %r", msg)
                continue
            pending.discard(msg.rank)
            if msg.error is not None:
                errors.append(f"rank {msg.rank}: {msg.error}")
                deadline = min(deadline, time.monotonic() + TP_ERROR_GRACE_S)
            elif msg.rank == 0:
                rank0 = msg
        if errors or rank0 is None:
            raise BatchFailedError("; ".join(errors) or "rank 0 returned no output")
        return rank0

    def _stop_workers(self) -> None:
        """Terminate every worker (a rank blocked in a collective never returns by itself) and wait until each is
        gone (killed if SIGTERM is not enough): none may write into the pool after this."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()
        logger.error("workers stopped: %s", self._dead_reason)

    def _split(self, batch: Batch, header: WorkerResultMsg) -> list[ItemResult]:
        if len(header.shapes) != len(batch.entries):
            raise BatchFailedError(f"rank 0 answered {len(header.shapes)} outputs for {len(batch.entries)} items")
        return [ItemResult(e.item.key, tuple(shape), header.dtype) for e, shape in zip(batch.entries, header.shapes)]

    def shutdown(self) -> None:
        """Ask workers to stop, then terminate stragglers; idempotent."""
        if any(p.is_alive() for p in self._procs) and self.check_workers() is None:
            try:
                self._broadcast.enqueue(
                    to_worker_encoder.encode(StopWorkerMsg("shutdown")),
                    [],
                    timeout=2.0,
                    should_abort=lambda: self.check_workers() is not None,
                )
            except Exception:  # workers may be gone already
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._results.close(linger=0)
        self._broadcast.close()
