"""Worker process, one per tensor-parallel rank: loads its shard of the workload's model and runs broadcast batches."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from eric_epd.common.cpus import pin_process, pin_torch
from eric_epd.common.heap import keep_freed_heap
from eric_epd.common.shm import attach_untracked
from eric_epd.runtime.config import RuntimeConfig
from eric_epd.runtime.executor.device_io import DeviceIO
from eric_epd.runtime.executor.messages import (
    ExecuteBatchMsg,
    StopWorkerMsg,
    WorkerReadyMsg,
    WorkerResultMsg,
    from_worker_encoder,
    to_worker_decoder,
)
from eric_epd.runtime.executor.shm_broadcast import (
    BroadcastAborted,
    BroadcastClosed,
    BroadcastHandle,
    ShmBroadcast,
    ShmBroadcastReader,
)
from eric_epd.runtime.executor.tensor_views import buffer_to_tensor
from eric_epd.runtime.workload import Runner, Workload

logger = logging.getLogger(__name__)
_DECODER = to_worker_decoder()
TEST_FAULT_ENV = "ERIC_TEST_FAULT_FAIL_BATCHES"
"""A test fault, off by default: comma-separated engine batch ids (0 is the first batch after the warm-up) that every
rank fails before its forward, as a model rejecting the batch would. Read once when the worker starts."""


def _test_fault_batches() -> frozenset[int]:
    """The batch ids TEST_FAULT_ENV names (none when unset)."""
    value = os.environ.get(TEST_FAULT_ENV, "").strip()
    ids = frozenset(int(v) for v in value.split(",") if v.strip())
    if ids:
        logger.warning("%s: batches %s will fail (a test fault)", TEST_FAULT_ENV, sorted(ids))
    return ids


@dataclass(frozen=True)
class WorkerArgs:
    """What the executor hands one worker at spawn."""

    config: RuntimeConfig
    workload: Workload
    rank: int
    broadcast: BroadcastHandle
    dist_init: str
    """torch.distributed init method: a file:// rendezvous in the server's private run directory."""


def _init_distributed(args: WorkerArgs, device: torch.device):  # -> TPContext
    from eric_epd.models.layers.parallel import TPContext

    world = args.config.tp_size
    if world == 1:
        return TPContext(rank=0, world_size=1, group=None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    bound = {"device_id": device} if device.type == "cuda" else {}  # NCCL communicators made now, not at batch 1
    torch.distributed.init_process_group(backend, init_method=args.dist_init, rank=args.rank, world_size=world, **bound)
    return TPContext(rank=args.rank, world_size=world, group=torch.distributed.group.WORLD)


def _load(args: WorkerArgs) -> tuple[Runner, torch.device]:
    device = torch.device(args.config.resolved_device())
    cpus = args.config.worker_cpus(args.rank)
    if device.type == "cuda":
        device = torch.device(args.config.rank_device(args.rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        pin_process(cpus)  # host-side work stays on this rank's CPUs
    else:
        pin_torch(cpus)  # this rank's slice, torch's pool sized to it
    tp = _init_distributed(args, device)
    return args.workload.load(args.config, device, tp), device


@dataclass
class _Prepared:
    """A batch taken off the broadcast: its inputs already on the device (its slot given back), or why not."""

    msg: ExecuteBatchMsg
    inputs: torch.Tensor | None
    error: str = ""


def _take(
    reader: ShmBroadcastReader, io: DeviceIO, dtype: torch.dtype, timeout: float, parent_gone: Callable[[], bool]
) -> _Prepared | StopWorkerMsg | None:
    """The next message (None if none within `timeout`); a batch's inputs are copied onto the device and its
    broadcast slot released at once, so the engine can already write the batch after it."""
    try:
        header, views = reader.dequeue(timeout=timeout, should_abort=parent_gone)
    except TimeoutError:
        return None
    try:
        msg = _DECODER.decode(header)
        if isinstance(msg, StopWorkerMsg):
            return msg
        try:
            parts = [buffer_to_tensor(v, item.input_dtype, (-1,)) for item, v in zip(msg.items, views, strict=True)]
            return _Prepared(msg, io.inputs(parts, dtype))
        except Exception as e:  # answered as this batch's error
            logger.exception("batch %d: cannot stage its inputs", msg.batch_id)
            return _Prepared(msg, None, repr(e))
    finally:
        reader.release()


def _serve(args: WorkerArgs, runner: Runner, device: torch.device, push: zmq.Socket) -> None:
    reader = ShmBroadcast.attach(args.broadcast, args.rank)
    segment = attach_untracked(args.config.pool_name) if args.rank == 0 else None
    pool = np.ndarray((segment.size,), np.uint8, buffer=segment.buf) if segment is not None else None
    io = DeviceIO(device, pool)
    parent = os.getppid()
    faults = _test_fault_batches()

    def parent_gone() -> bool:
        return os.getppid() != parent

    def peek() -> _Prepared | StopWorkerMsg | None:
        """On CUDA: the next batch, if the engine already sent it, staged while this one computes."""
        if not io.overlaps:
            return None
        try:
            return _take(reader, io, runner.dtype, 0.0, parent_gone)
        except BroadcastAborted as e:  # closed or parent gone: stop after answering this batch
            return StopWorkerMsg(str(e))

    taken: _Prepared | StopWorkerMsg | None = None
    try:
        while not parent_gone():
            if taken is None:
                taken = _take(reader, io, runner.dtype, 1.0, parent_gone)
            if taken is None:
                continue
            if isinstance(taken, StopWorkerMsg):
                return
            taken = _execute_and_reply(args.rank, runner, taken, io, push, peek, faults)
    except BroadcastClosed:
        return
    finally:
        io.close()
        reader.close()
        if segment is not None:
            del io, pool  # views on the segment
            segment.close()


def _execute_and_reply(
    rank: int,
    runner: Runner,
    batch: _Prepared,
    io: DeviceIO,
    push: zmq.Socket,
    peek: Callable[[], _Prepared | StopWorkerMsg | None],
    faults: frozenset[int] = frozenset(),
) -> _Prepared | StopWorkerMsg | None:
    """Run one batch and answer it; returns the next message if `peek` took it while the forward ran. A batch whose
    id is in `faults` (TEST_FAULT_ENV) fails."""
    msg, upcoming = batch.msg, None
    try:
        if batch.inputs is None:
            raise RuntimeError(batch.error)
        if msg.batch_id in faults and not msg.warmup:
            raise RuntimeError(f"test fault: batch {msg.batch_id} fails ({TEST_FAULT_ENV})")
        start = time.perf_counter()
        with torch.inference_mode():
            outputs = runner.run(msg.items, batch.inputs)
        upcoming = peek()  # the device still runs this forward: the next batch's copies overlap it
        io.sync()
        compute_s = time.perf_counter() - start
        write_s = io.write(outputs, msg) if rank == 0 and not msg.warmup else 0.0  # only rank 0's output leaves
    except Exception as e:  # reported to the engine, which fails the batch's requests
        logger.exception("rank %d: batch %d failed", rank, msg.batch_id)
        push.send_multipart([from_worker_encoder.encode(WorkerResultMsg(msg.batch_id, rank, error=repr(e)))])
        return upcoming
    dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else ""
    result = WorkerResultMsg(
        msg.batch_id,
        rank,
        shapes=[tuple(o.shape) for o in outputs],
        dtype=dtype,
        compute_seconds=compute_s,
        write_seconds=write_s,
    )
    push.send(from_worker_encoder.encode(result))
    return upcoming


def main(args: WorkerArgs) -> None:
    """Child-side entry point: load, report ready (or the load error), then serve until told to stop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(name)s %(levelname)s %(message)s")
    keep_freed_heap(args.config.heap_keep_bytes)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(args.config.worker_result_addr)
    try:
        start = time.perf_counter()
        try:
            runner, device = _load(args)
        except Exception as e:
            logger.exception("rank %d failed to load the model", args.rank)
            push.send(from_worker_encoder.encode(WorkerReadyMsg(args.rank, os.getpid(), error=repr(e))))
            return
        logger.info("rank %d loaded %s on %s in %.1fs", args.rank, runner.dtype, device, time.perf_counter() - start)
        ready = WorkerReadyMsg(
            args.rank,
            os.getpid(),
            cpus=sorted(os.sched_getaffinity(0)),
            threads=torch.get_num_threads() if device.type == "cpu" else 0,
        )
        push.send(from_worker_encoder.encode(ready))
        _serve(args, runner, device, push)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        push.close()
        ctx.term()
