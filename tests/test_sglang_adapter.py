"""Eric behind SGLang 0.5.23's `--language-only --encoder-urls`: SGLang's own receiver classes, imported from the
installed sglang (never copied), against live Erics, for every encoder transfer SGLang has plus NIXL (our plugin).

SGLang cannot run a model on this CPU, so the prefill side runs in a spawned "prefill host" process that does
what SGLang's TokenizerManager and Scheduler do around their encoder receivers: ServerArgs + resolution + publish,
load_plugins() (our entry point), EncoderBootstrapServer, create_mm_receiver, send_encode_request / recv_mm_data on
the tokenizer side, and TP scheduler ranks (forked processes joined by SGLang's own gloo TP group) that call
MMReceiverHTTP.process_waiting_requests with TokenizedGenerateReqInput until the request is ready or aborted.
The multimodal processor that lays the embeddings out (input_ids, offsets, M-RoPE) is SGLang's real
QwenVLImageProcessor. Stand-ins, for the model runner only: `FakeSchedulerStandIn` (the attributes the receiver
reads off the Scheduler) and `CpuLandingPoolStandIn` (SGLang's EmbeddingPool with its landing buffer in host
memory instead of cuda:N; its allocator and the RDMA landing logic are SGLang's).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch

from eric_epd.testing.media import image_bytes, random_image, video_data_url
from eric_epd.testing.server import EricServer, free_port

README = Path(__file__).resolve().parents[1] / "eric_epd" / "plugins" / "sglang" / "README.md"
RTOL, ATOL = 1e-4, 1e-5  # float32, as tests/test_server.py: Eric's batched varlen attention vs HF per image
IMAGES = [(64, 48, 1), (40, 90, 2), (112, 84, 3)]  # (width, height, seed); different sizes catch misplaced rows
SPLIT_IMAGES = [(56, 56, 11), (84, 28, 12), (28, 112, 13), (70, 98, 14)]
IMAGE_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_TAG = "<|vision_start|><|video_pad|><|vision_end|>"
PREFILL_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",  # receivers advertise loopback (the machine's NIC address would also do)
    "MOONCAKE_PROTOCOL": "tcp",  # SGLang's receiver engine; Eric's push engine uses --mooncake-protocol (tcp)
    "MC_LOG_LEVEL": "ERROR",
    "SGLANG_EMBEDDING_POOL_SIZE_MB": "0",  # no cuda pool; the ranks get CpuLandingPoolStandIn instead
    "TOKENIZERS_PARALLELISM": "false",
}


def image_url(width: int, height: int, seed: int) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image_bytes(random_image(width, height, seed))).decode()


def prompt_for(num_images: int, num_videos: int = 0) -> str:
    return "Describe " + " and ".join([IMAGE_TAG] * num_images + [VIDEO_TAG] * num_videos) + " please."


# ------------------------------------------------------------------------------------------------ messages
# Everything crossing a process boundary in this harness is msgspec msgpack over Connection.send_bytes.


class Tensor(msgspec.Struct):
    data: bytes
    shape: list[int]
    dtype: str


def pack(t: torch.Tensor) -> Tensor:
    t = t.detach().cpu().contiguous()
    return Tensor(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", list(t.shape),
                  str(t.dtype).removeprefix("torch."))


def unpack(t: Tensor) -> torch.Tensor:
    dtype = getattr(torch, t.dtype)
    return torch.frombuffer(bytearray(t.data), dtype=torch.uint8).view(dtype).reshape(t.shape).clone()


class Outcome(msgspec.Struct, kw_only=True):
    """What one SGLang receiver ended up holding, or how it failed."""

    ok: bool
    error_msg: str | None = None
    error_code: int | None = None
    embeddings: list[Tensor] = msgspec.field(default_factory=list)
    """mm_items[i].precomputed_embeddings, in prompt order."""
    modalities: list[str] = msgspec.field(default_factory=list)
    input_ids: list[int] = msgspec.field(default_factory=list)
    mrope: Tensor | None = None
    grid: dict[str, list[list[int]]] = msgspec.field(default_factory=dict)
    """img_grid_thw / video_grid_thw the receiver handed SGLang's processor."""
    extra: dict[str, list[float]] = msgspec.field(default_factory=dict)
    rank: int = -1
    engine: str = ""


class Job(msgspec.Struct, kw_only=True):
    kind: str  # "tokenizer" (zmq_to_tokenizer) or "scheduler" (zmq_to_scheduler, mooncake, nixl)
    model: str
    backend: str
    encoder_urls: list[str]
    images: list[str] = msgspec.field(default_factory=list)
    videos: list[str] = msgspec.field(default_factory=list)
    prompt: str = ""
    tp: int = 1
    env: dict[str, str] = msgspec.field(default_factory=dict)
    use_bootstrap: bool = False
    local_reference: bool = False
    dtype: str = "auto"  # the prefill's --dtype
    timeout_s: float = 120.0


class JobResult(msgspec.Struct, kw_only=True):
    outcomes: list[Outcome]
    local: Outcome | None = None
    dispatch_error: str | None = None


class RankJob(msgspec.Struct, tag=True, kw_only=True):
    model: str
    backend: str
    encoder_urls: list[str]
    rid: str
    prompt: str
    num_items_assigned: dict[str, list[int]]
    env: dict[str, str]
    dtype: str
    timeout_s: float


class RankEvent(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    error_msg: str
    error_code: int


class ParseArgs(msgspec.Struct, tag=True):
    argv: list[str]


class ParsedArgs(msgspec.Struct, kw_only=True):
    error: str | None = None
    language_only: bool = False
    encoder_only: bool = False
    encoder_urls: list[str] = msgspec.field(default_factory=list)
    encoder_transfer_backend: str = ""
    resolved_backend: str = ""
    encoder_register_urls: list[str] = msgspec.field(default_factory=list)
    encoder_bootstrap_port: int = 0
    tp_size: int = 1
    nixl_env: str = ""


class WireCheck(msgspec.Struct, tag=True):
    pass


class RunJob(msgspec.Struct, tag=True):
    job: Job


class Bootstrap(msgspec.Struct, tag=True):
    port: int


class BootstrapUrls(msgspec.Struct, tag=True):
    pass


class Stop(msgspec.Struct, tag=True):
    pass


Command = ParseArgs | WireCheck | RunJob | Bootstrap | BootstrapUrls | Stop


# ------------------------------------------------------------------------------------------- SGLang side


def _outcome_from_mm(mm: Any, captured: dict[str, Any], rank: int = -1, engine: str = "") -> Outcome:
    grid = {k: v.tolist() for k, v in captured.items() if k.endswith("grid_thw") and v is not None}
    extra = {k: [float(x) for x in v] for k, v in captured.items() if k == "second_per_grid_ts" and v is not None}
    return Outcome(ok=True, embeddings=[pack(i.precomputed_embeddings) for i in mm.mm_items],
                   modalities=[i.modality.name for i in mm.mm_items], input_ids=[int(x) for x in mm.input_ids],
                   mrope=pack(mm.mrope_positions) if mm.mrope_positions is not None else None, grid=grid,
                   extra=extra, rank=rank, engine=engine)


def _spy_grids(mm_processor: Any, captured: dict[str, Any]) -> None:
    """Record the kwargs the receiver hands SGLang's processor (grids, video metadata); behaviour unchanged."""
    real = mm_processor.get_validated_mm_data

    def spy(prompt: Any, embeddings: Any, **kwargs: Any) -> Any:
        captured.update(kwargs)
        return real(prompt, embeddings, **kwargs)

    mm_processor.get_validated_mm_data = spy


def _server_args(job_model: str, backend: str, urls: list[str], tp: int, dtype: str) -> Any:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=job_model, language_only=True, encoder_urls=urls, encoder_transfer_backend=backend,
                      device="cpu", host="127.0.0.1", tp_size=tp, dtype=dtype)
    args.resolve_once()
    return args


class FakeSchedulerStandIn:
    """Stands in for SGLang's Scheduler (it owns the model runner, which cannot run here): only the attributes
    MMReceiverBase reads from it. model_config is SGLang's own ModelConfig for the checkpoint."""

    def __init__(self, args: Any) -> None:
        from types import SimpleNamespace

        from sglang.srt.configs.model_config import ModelConfig
        from transformers import AutoTokenizer

        self.model_config = ModelConfig.from_server_args(args)
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.disaggregation_mode = None
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.metrics_collector = None
        self.dllm_config = None


def _cpu_landing_pool(engine: Any, size: int = 64 << 20) -> Any:
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingPool

    class CpuLandingPoolStandIn(EmbeddingPool):
        """SGLang's EmbeddingPool (first-fit slots, RDMA-registered once) with its buffer in host memory: this
        machine has no cuda:N for the receiver's landing buffers."""

        def __init__(self, engine: Any, size_bytes: int) -> None:
            self.gpu_id, self.size_bytes = 0, size_bytes
            self.buffer = torch.zeros(size_bytes, dtype=torch.uint8)
            self.base, self.engine = self.buffer.data_ptr(), engine
            engine.register(self.base, self.buffer.nbytes)
            self._segments_free, self._inflight = [(0, size_bytes)], {}
            self._next_slot_id, self._total_inflight = 0, 0
            self._lock = threading.Lock()
            self._cond = threading.Condition(self._lock)

    return CpuLandingPoolStandIn(engine, size)


def _rank_main(conn: Any, world_rank: int, tp: int, port: int) -> None:
    """One scheduler TP rank (forked from the prefill host after load_plugins, as SGLang's scheduler loads them)."""
    decoder = msgspec.msgpack.Decoder(RankJob | RankEvent | Stop)
    pools: dict[int, Any] = {}
    while True:
        cmd = decoder.decode(conn.recv_bytes())
        if isinstance(cmd, Stop):
            os._exit(0)
        if isinstance(cmd, RankEvent):
            continue  # a dispatch error for a request already finished
        saved_env = {k: os.environ.get(k) for k in cmd.env}
        try:
            outcome = _rank_job(cmd, world_rank, tp, port, conn, decoder, pools)
        except Exception:
            import traceback

            outcome = Outcome(ok=False, error_msg="HARNESS ERROR " + traceback.format_exc(), rank=world_rank)
        _restore_env(saved_env)
        conn.send_bytes(msgspec.msgpack.encode(outcome))


def _rank_job(cmd: RankJob, world_rank: int, tp: int, port: int, conn: Any, decoder: Any,
              pools: dict[int, Any]) -> Outcome:
    """What Scheduler does around its MMReceiverHTTP for one tokenized request, until it is ready or aborted."""
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP
    from sglang.srt.distributed import parallel_state
    from sglang.srt.managers.io_struct import EncoderDispatchErrorReq, TokenizedGenerateReqInput
    from sglang.srt.multimodal.modality import Modality
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.sampling.sampling_params import SamplingParams

    from eric_epd.plugins.sglang import plugin

    os.environ.pop(plugin.ENV, None)
    os.environ.update(cmd.env)
    args = _server_args(cmd.model, cmd.backend, cmd.encoder_urls, tp, cmd.dtype)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=0))
    if not torch.distributed.is_initialized():  # SGLang's own TP group, on gloo
        parallel_state.init_distributed_environment(world_size=tp, rank=world_rank, local_rank=world_rank,
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                                                    backend="gloo")
        parallel_state.initialize_model_parallel()
    scheduler = FakeSchedulerStandIn(args)  # as Scheduler.__init__: create_mm_receiver(model_config.dtype, ...)
    receiver = MMReceiverHTTP(args, dtype=scheduler.model_config.dtype, hf_config=scheduler.model_config.hf_config,
                              scheduler=scheduler)
    engine = getattr(receiver, "embeddings_engine", None)
    if engine is not None:
        if id(engine) not in pools:
            pools[id(engine)] = _cpu_landing_pool(engine)
        receiver.embedding_pool = pools[id(engine)]
    captured: dict[str, Any] = {}
    _spy_grids(receiver.mm_processor, captured)
    req = TokenizedGenerateReqInput(
        rid=cmd.rid, input_text=cmd.prompt, input_ids=None, input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False, need_wait_for_mm_inputs=True,
        num_items_assigned={Modality[k]: v for k, v in cmd.num_items_assigned.items()},
        encoder_urls=cmd.encoder_urls)
    engine_name = type(engine).__name__ if engine is not None else ""
    pending: list[Any] = [req]
    deadline = time.monotonic() + cmd.timeout_s
    while True:
        while conn.poll(0):
            event = decoder.decode(conn.recv_bytes())
            if isinstance(event, RankEvent):
                pending.append(EncoderDispatchErrorReq(rid=event.rid, error_msg=event.error_msg,
                                                       error_code=event.error_code))
        ready, aborts = receiver.process_waiting_requests(pending)
        pending = []
        if ready:
            return _outcome_from_mm(ready[0].mm_inputs, captured, world_rank, engine_name)
        if aborts:
            _, message, code = aborts[0]
            return Outcome(ok=False, error_msg=str(message), error_code=int(code) if code else None,
                           rank=world_rank, engine=engine_name)
        if time.monotonic() > deadline:
            return Outcome(ok=False, error_msg="harness: no outcome in time", rank=world_rank)
        time.sleep(0.005)


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class PrefillHost:
    """Runs in the spawned prefill process: the tokenizer-manager side and the rank groups."""

    def __init__(self) -> None:
        import sglang.srt.managers.tokenizer_manager  # noqa: F401  (imported as the real prefill would)
        from sglang.srt.plugins import load_plugins

        load_plugins()  # discovers eric_epd's `sglang.srt.plugins` entry point and applies its hooks
        ctx = multiprocessing.get_context("fork")  # after the imports and hooks, before any thread starts
        self.groups: dict[int, list[Any]] = {}
        for tp in (1, 2):
            port, conns = free_port(), []
            for rank in range(tp):
                parent, child = ctx.Pipe()
                ctx.Process(target=_rank_main, args=(child, rank, tp, port), daemon=True).start()
                conns.append(parent)
            self.groups[tp] = conns
        self.bootstrap: Any = None
        self.bootstrap_urls: list[str] = []
        self._send_lock = threading.Lock()

    def parse(self, argv: list[str]) -> ParsedArgs:
        from sglang.srt.runtime_context import get_disagg, publish
        from sglang.srt.server_args import prepare_server_args

        from eric_epd.plugins.sglang import plugin

        os.environ.pop(plugin.ENV, None)
        try:
            args = prepare_server_args(argv)
            raw = (args.encoder_transfer_backend, list(args.encoder_urls), list(args.encoder_register_urls))
            args.resolve_once()
            publish(args, role="tokenizer")
        except BaseException as e:  # argparse exits with SystemExit
            return ParsedArgs(error=f"{type(e).__name__}: {e}")
        d = get_disagg()
        return ParsedArgs(language_only=d.language_only, encoder_only=d.encoder_only, encoder_urls=raw[1],
                          encoder_transfer_backend=raw[0], resolved_backend=d.encoder_transfer_backend,
                          encoder_register_urls=raw[2], encoder_bootstrap_port=d.encoder_bootstrap_port,
                          tp_size=args.tp_size, nixl_env=os.environ.get(plugin.ENV, ""))

    def wire_check(self) -> str:
        """Eric's part message, read by SGLang's SafeUnpickler, against the EmbeddingData SGLang's encoder sends."""
        from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
        from sglang.srt.multimodal.modality import Modality
        from sglang.srt.utils.common import safe_pickle_loads

        from eric_epd.plugins.sglang.wire import EmbeddingPart, embedding_data_pickle

        theirs = EmbeddingData("r_local_part_1", 2, 1, torch.tensor([[1, 4, 6]]), Modality.IMAGE,
                               torch.zeros(6, 32)).copy_without_embedding()
        ours = safe_pickle_loads(embedding_data_pickle(EmbeddingPart(
            req_id="r_local_part_1", num_parts=2, part_idx=1, modality="IMAGE", grid=[[1, 4, 6]], dtype="float32",
            shape=[6, 32])))
        a, b = dict(vars(theirs)), dict(vars(ours))
        if type(ours) is not EmbeddingData or torch.as_tensor(b.pop("grid_dim")).tolist() != \
                a.pop("grid_dim").tolist() or a != b:
            return f"mismatch: SGLang {vars(theirs)} vs Eric {vars(ours)}"
        err = safe_pickle_loads(embedding_data_pickle(EmbeddingPart(
            req_id="e", num_parts=1, part_idx=0, modality="VIDEO", grid=None, dtype=None, shape=None,
            error_msg="bad", error_code=400)))
        ref = EmbeddingData("e", 1, 0, None, Modality.VIDEO, error_msg="bad", error_code=400).copy_without_embedding()
        return "ok" if vars(err) == vars(ref) else f"error mismatch: {vars(ref)} vs {vars(err)}"

    def start_bootstrap(self, port: int) -> None:
        from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

        self.bootstrap = EncoderBootstrapServer("127.0.0.1", port, urls=self.bootstrap_urls, health_check_interval=2.0,
                                                health_check_timeout=10.0)

    def _tokenizer_side(self, job: Job) -> tuple[Any, Any]:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
        from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
        from sglang.srt.multimodal.transport import determine_tensor_transport_mode
        from sglang.srt.runtime_context import publish
        from sglang.srt.utils.hf_transformers_utils import get_processor

        from eric_epd.plugins.sglang import plugin

        os.environ.pop(plugin.ENV, None)
        args = _server_args(job.model, job.backend, [] if job.use_bootstrap else job.encoder_urls, job.tp, job.dtype)
        publish(args, role="tokenizer")
        model_config = ModelConfig.from_server_args(args)
        import_processors("sglang.srt.multimodal.processors")
        mm_processor = get_mm_processor(model_config.hf_config, args, get_processor(job.model),
                                        determine_tensor_transport_mode(), model_config=model_config)
        # As TokenizerManager: the receiver shares the bootstrap server's URL list (pre-filled by --encoder-urls).
        urls = self.bootstrap_urls if job.use_bootstrap else list(job.encoder_urls)
        receiver = create_mm_receiver(args, dtype=model_config.dtype, hf_config=model_config.hf_config,
                                      encode_urls=urls)
        return mm_processor, receiver

    def run(self, job: Job) -> JobResult:
        saved = {k: os.environ.get(k) for k in job.env}
        os.environ.update(job.env)
        try:
            return self._run(job)
        finally:
            _restore_env(saved)

    def _run(self, job: Job) -> JobResult:
        from sglang.srt.managers.io_struct import GenerateReqInput

        mm_processor, receiver = self._tokenizer_side(job)
        obj = GenerateReqInput(text=job.prompt, image_data=job.images or None, video_data=job.videos or None)
        obj.rid = uuid.uuid4().hex
        if job.kind == "tokenizer":
            return self._run_tokenizer(job, obj, mm_processor, receiver)
        ranks = self.groups[job.tp]
        errors: list[str] = []

        def on_dispatch_error(err: Any) -> None:  # TokenizerManager forwards this to the scheduler
            errors.append(f"{err.error_code} {err.error_msg}")
            event = msgspec.msgpack.encode(RankEvent(rid=err.rid, error_msg=err.error_msg,
                                                     error_code=int(err.error_code)))
            with self._send_lock:
                for conn in ranks:
                    conn.send_bytes(event)

        ready = receiver.send_encode_request(obj, on_dispatch_error=on_dispatch_error)
        assert ready is not None, "the tokenizer did not dispatch to an encoder"
        rank_job = msgspec.msgpack.encode(RankJob(
            model=job.model, backend=job.backend, encoder_urls=list(obj.encoder_urls), rid=obj.rid, prompt=job.prompt,
            num_items_assigned={m.name: list(v) for m, v in obj.num_items_assigned.items()}, env=job.env,
            dtype=job.dtype, timeout_s=job.timeout_s))
        with self._send_lock:
            for conn in ranks:
                conn.send_bytes(rank_job)
        ready.set()  # the tokenized request is with the scheduler
        outcomes = [msgspec.msgpack.decode(conn.recv_bytes(), type=Outcome) for conn in ranks]
        return JobResult(outcomes=outcomes, dispatch_error=errors[0] if errors else None)

    def _run_tokenizer(self, job: Job, obj: Any, mm_processor: Any, receiver: Any) -> JobResult:
        from fastapi import HTTPException
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.managers.tokenizer_manager import _reject_missing_dispatched_encoder_embedding

        captured: dict[str, Any] = {}
        _spy_grids(mm_processor, captured)
        obj.need_wait_for_mm_inputs = True  # what TokenizerManager sets when it dispatches to encoders
        mm = asyncio.run(receiver.recv_mm_data(obj, mm_processor, job.prompt, need_wait_for_mm_inputs=True))
        if mm is None:
            try:  # what TokenizerManager does with a missing dispatched embedding
                _reject_missing_dispatched_encoder_embedding(obj, mm)
                outcome = Outcome(ok=False, error_msg="not rejected")
            except HTTPException as e:
                outcome = Outcome(ok=False, error_msg=str(e.detail), error_code=e.status_code)
        else:
            outcome = _outcome_from_mm(mm, captured)
        local = None
        if job.local_reference:  # SGLang's own, non-disaggregated path: its HF preprocessing and placement
            ref = GenerateReqInput(text=job.prompt, image_data=job.images or None)
            local_mm = asyncio.run(mm_processor.process_mm_data_async(
                image_data=job.images, input_text=job.prompt, request_obj=ref, max_req_input_len=4096))
            local = Outcome(ok=True, input_ids=[int(x) for x in local_mm.input_ids],
                            mrope=pack(local_mm.mrope_positions),
                            grid={"img_grid_thw": torch.cat([i.image_grid_thw for i in local_mm.mm_items]).tolist()})
        return JobResult(outcomes=[outcome], local=local)

    def serve(self, conn: Any) -> None:
        decoder = msgspec.msgpack.Decoder(Command)
        while True:
            cmd = decoder.decode(conn.recv_bytes())
            try:
                reply = self.handle(cmd)
            except Exception:
                import traceback

                reply = "HARNESS ERROR " + traceback.format_exc()
            conn.send_bytes(msgspec.msgpack.encode(reply))
            if isinstance(cmd, Stop):
                return

    def handle(self, cmd: Any) -> Any:
        if isinstance(cmd, Stop):
            for conns in self.groups.values():
                for c in conns:
                    with contextlib.suppress(OSError):
                        c.send_bytes(msgspec.msgpack.encode(Stop()))
            if self.bootstrap is not None:
                self.bootstrap.close()
            return "stopped"
        if isinstance(cmd, ParseArgs):
            return self.parse(cmd.argv)
        if isinstance(cmd, WireCheck):
            return self.wire_check()
        if isinstance(cmd, RunJob):
            return self.run(cmd.job)
        if isinstance(cmd, Bootstrap):
            self.start_bootstrap(cmd.port)
            return "ok"
        return list(self.bootstrap.list_urls()) if self.bootstrap else []


def _prefill_main(conn: Any, entry_point_dir: str) -> None:
    os.environ.update(PREFILL_ENV)
    sys.path.insert(0, entry_point_dir)
    try:
        host = PrefillHost()
        conn.send_bytes(b"ready")
        host.serve(conn)
    except BaseException as e:
        import traceback

        conn.send_bytes(msgspec.msgpack.encode(f"prefill host failed: {e!r}\n{traceback.format_exc()}"))
        raise


class Prefill:
    """Test-side handle on the prefill host process."""

    def __init__(self, entry_point_dir: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, str(entry_point_dir)))  # forks the ranks
        self.proc.start()

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("prefill host not ready")
        first = self.conn.recv_bytes()
        if first != b"ready":
            raise RuntimeError(msgspec.msgpack.decode(first))

    def call(self, cmd: Any, reply: Any = Any, timeout_s: float = 300.0) -> Any:
        self.conn.send_bytes(msgspec.msgpack.encode(cmd))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"prefill host did not answer {type(cmd).__name__}")
        raw = msgspec.msgpack.decode(self.conn.recv_bytes())
        if isinstance(raw, str) and raw.startswith("HARNESS ERROR"):
            raise RuntimeError(raw)
        return msgspec.convert(raw, reply)

    def job(self, **kwargs: Any) -> JobResult:
        return self.call(RunJob(Job(**kwargs)), JobResult)

    def stop(self) -> None:
        try:
            self.conn.send_bytes(msgspec.msgpack.encode(Stop()))
            self.conn.poll(20)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def bootstrap_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def setup(qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path, bootstrap_port: int, tmp_path_factory: pytest.TempPathFactory):
    """Three Erics (booting while the prefill host imports SGLang) and the prefill host.

    A: Qwen2-VL, parts sent as float16 (SGLang's --dtype auto for these float32 checkpoints; Eric converts).
    B: Qwen2.5-VL, ERIC_SGLANG_DTYPE=float32 for prefills run with --dtype float32 (no conversion).
    C: Qwen2-VL like A, and it registers itself with the prefill's EncoderBootstrapServer.
    """
    tmp = tmp_path_factory.mktemp("sglang")
    dist = tmp / "entry" / "eric_epd_sglang_entry_point-0.0.0.dist-info"  # eric_epd's plugin entry point
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eric-epd-sglang-entry-point\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\neric_epd = eric_epd.plugins.sglang.plugin:register\n")
    backends = ("--transfer-backends", "shm")
    erics = {  # A also runs Eric's own Mooncake and NIXL producers, beside the adapter's push engines
        "A": (EricServer(qwen2_vl_tiny, extra_args=("--transfer-backends", "shm,mooncake,nixl"),
                         log_path=tmp / "A.log"), {}),
        "B": (EricServer(qwen2_5_vl_tiny, extra_args=backends, log_path=tmp / "B.log"),
              {"ERIC_SGLANG_DTYPE": "float32"}),
        "C": (EricServer(qwen2_vl_tiny, extra_args=backends, log_path=tmp / "C.log"),
              {"ERIC_SGLANG_REGISTER_URLS": f"http://127.0.0.1:{bootstrap_port}"}),  # retries every 5 s for 150 s
    }
    errors: list[BaseException] = []

    def boot(eric: EricServer) -> None:
        try:
            eric.start()
        except BaseException as e:
            errors.append(e)

    threads = []
    for eric, env in erics.values():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        threads.append(threading.Thread(target=boot, args=(eric,)))
        threads[-1].start()
        while eric.proc is None and threads[-1].is_alive():  # until Popen has copied the environment
            time.sleep(0.01)
        _restore_env(saved)
    prefill = Prefill(tmp / "entry")
    try:
        prefill.wait_ready()
        prefill.call(Bootstrap(bootstrap_port))
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        yield prefill, {name: eric for name, (eric, _) in erics.items()}
    finally:
        prefill.stop()
        for eric, _ in erics.values():
            if eric.proc is not None and eric.proc.poll() is None:
                os.kill(eric.proc.pid, signal.SIGCONT)
            eric.stop()


@pytest.fixture(scope="module")
def references(qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> dict[str, dict[str, Any]]:
    """transformers' get_image_features and image_grid_thw, per checkpoint, for IMAGES and SPLIT_IMAGES."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out: dict[str, dict[str, Any]] = {}
    for family, ckpt in (("qwen2_vl", qwen2_vl_tiny), ("qwen2_5_vl", qwen2_5_vl_tiny)):
        processor = AutoProcessor.from_pretrained(ckpt)
        model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
        for name, specs in (("images", IMAGES), ("split", SPLIT_IMAGES)):
            inputs = processor.image_processor(images=[random_image(w, h, s) for w, h, s in specs],
                                               return_tensors="pt")
            with torch.no_grad():
                feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            out.setdefault(family, {})[name] = (list(feats.pooler_output), inputs["image_grid_thw"].tolist())
    return out


def eric_tensors(eric: EricServer, urls: list[str], modality: str = "image") -> list[tuple[torch.Tensor, list[int]]]:
    """Eric's own tensors for these media: native /v1/encode, then the transfer client (HTTP), then ack."""
    from eric_epd.transfer.client import EmbeddingFetcher

    resp = httpx.post(eric.url + "/v1/encode", json={"items": [{"modality": modality, "url": u} for u in urls]},
                      timeout=120)
    assert resp.status_code == 200, resp.text
    fetcher = EmbeddingFetcher(["http"])
    try:
        return [(fetcher.fetch(item["handle"]), item["grid_thw"]) for item in resp.json()["items"]]
    finally:
        fetcher.close()


def check_equal(outcome: Outcome, eric: list[tuple[torch.Tensor, list[int]]],
                hf: tuple[list[torch.Tensor], list] | None, dtype: torch.dtype, modality: str = "IMAGE") -> None:
    """The receiver's rows are Eric's (within one rounding step: a re-encode may batch differently), in the
    prefill's dtype (a float32 -> float16 cast is Eric's
    Tensor.to), and transformers' within float32 (RTOL/ATOL) or float16 rounding (1e-3) tolerance."""
    assert outcome.ok, f"rank {outcome.rank}: {outcome.error_code} {outcome.error_msg}"
    got = [unpack(t) for t, m in zip(outcome.embeddings, outcome.modalities) if m == modality]
    assert len(got) == len(eric)
    for i, (mine, (ours, _grid)) in enumerate(zip(got, eric)):
        assert mine.dtype == dtype
        # `ours` is a second encode of the same content; its batch may differ, and batched matmuls are not
        # bit-stable across batch shapes, so compare within one rounding step of the prefill's dtype
        close = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
        torch.testing.assert_close(mine.float(), ours.to(dtype).float(), **close,
                                   msg=lambda m, i=i: f"item {i}: SGLang's receiver holds other rows than Eric: {m}")
        if hf is not None:
            tol = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
            torch.testing.assert_close(mine.float(), hf[0][i], **tol, msg=lambda m, i=i: f"item {i}: {m}")
    key = "img_grid_thw" if modality == "IMAGE" else "video_grid_thw"
    assert outcome.grid[key] == [g for _, g in eric]
    if hf is not None:
        assert outcome.grid[key] == hf[1]


def items_counter(eric: EricServer) -> float:
    text = httpx.get(eric.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^eric_items_total\{[^}]*modality="image"[^}]*\} (\S+)$', text, re.M))


# ---------------------------------------------------------------------------------------------------- tests


def documented_commands() -> list[list[str]]:
    """The SGLang command lines in eric_epd/plugins/sglang/README.md."""
    import shlex

    return [shlex.split(line)[3:] for line in README.read_text().splitlines()
            if line.startswith("python -m sglang.launch_server")]


def test_sglang_parser_accepts_documented_command_lines(setup, qwen2_vl_tiny: Path) -> None:
    prefill, _ = setup
    commands = documented_commands()
    assert len(commands) >= 5, "README lists the prefill command lines"
    seen = set()
    for argv in commands:
        argv = [str(qwen2_vl_tiny) if a == "/models/Qwen2.5-VL-7B-Instruct" else a for a in argv]
        parsed = prefill.call(ParseArgs([*argv, "--device", "cpu"]), ParsedArgs)  # this host has no GPU
        assert parsed.error is None, f"{argv}: {parsed.error}"
        assert parsed.language_only and not parsed.encoder_only
        seen.add(parsed.encoder_transfer_backend)
        if parsed.encoder_transfer_backend == "nixl":  # the plugin's flag resolves to SGLang's pull flow + NIXL
            assert (parsed.resolved_backend, parsed.nixl_env) == ("mooncake", "nixl")
        else:
            assert parsed.resolved_backend == parsed.encoder_transfer_backend and parsed.nixl_env == ""
        assert parsed.encoder_urls or parsed.encoder_bootstrap_port == 8997
    assert {"zmq_to_scheduler", "zmq_to_tokenizer", "mooncake", "nixl"} <= seen
    bad = prefill.call(ParseArgs(["--model-path", str(qwen2_vl_tiny), "--language-only",
                                  "--encoder-transfer-backend", "carrier-pigeon"]), ParsedArgs)
    assert bad.error is not None and "SystemExit" in bad.error  # argparse still refuses unknown backends
    refused = prefill.call(ParseArgs(["--model-path", str(qwen2_vl_tiny), "--encoder-only", "--device", "cpu",
                                      "--encoder-transfer-backend", "nixl"]), ParsedArgs)
    assert refused.error is not None and "Eric" in refused.error


def test_part_message_is_the_embedding_data_sglang_sends(setup) -> None:
    prefill, _ = setup
    assert prefill.call(WireCheck(), str) == "ok"


def test_zmq_to_tokenizer_qwen2_vl(setup, references, qwen2_vl_tiny: Path) -> None:
    """Tokenizer-side receiver; SGLang's own local processing of the same images places the tokens the same way."""
    prefill, erics = setup
    urls = [image_url(*spec) for spec in IMAGES]
    result = prefill.job(kind="tokenizer", model=str(qwen2_vl_tiny), backend="zmq_to_tokenizer",
                         encoder_urls=[erics["A"].url], images=urls, prompt=prompt_for(len(urls)),
                         local_reference=True)
    (outcome,) = result.outcomes
    check_equal(outcome, eric_tensors(erics["A"], urls), references["qwen2_vl"]["images"], torch.float16)
    local = result.local
    assert local is not None and local.grid["img_grid_thw"] == outcome.grid["img_grid_thw"]
    assert outcome.input_ids == local.input_ids  # the same placeholder expansion as SGLang's own preprocessing
    assert torch.equal(unpack(outcome.mrope), unpack(local.mrope))  # the same M-RoPE positions


@pytest.mark.parametrize("backend,family", [
    ("zmq_to_scheduler", "qwen2_5_vl"),
    ("mooncake", "qwen2_vl"),
    ("nixl", "qwen2_5_vl"),
    ("nixl", "qwen2_vl"),
])
def test_scheduler_ranks_tp2(setup, references, qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path, backend: str,
                             family: str) -> None:
    """Two TP ranks (receive_count 2, SGLang's gloo TP group) each end up holding Eric's rows."""
    prefill, erics = setup
    ckpt, eric, dtype = ((qwen2_vl_tiny, erics["A"], "auto") if family == "qwen2_vl"
                         else (qwen2_5_vl_tiny, erics["B"], "float32"))
    urls = [image_url(*spec) for spec in IMAGES]
    result = prefill.job(kind="scheduler", model=str(ckpt), backend=backend, encoder_urls=[eric.url], images=urls,
                         prompt=prompt_for(len(urls)), tp=2, dtype=dtype)
    assert result.dispatch_error is None
    expected = eric_tensors(eric, urls)
    assert [o.rank for o in result.outcomes] == [0, 1]
    for outcome in result.outcomes:
        check_equal(outcome, expected, references[family]["images"],
                    torch.float16 if dtype == "auto" else torch.float32)
        assert outcome.engine == {"nixl": "NixlLandingEngine", "mooncake": "MooncakeTransferEngine"}.get(backend, "")
    assert result.outcomes[0].input_ids == result.outcomes[1].input_ids


def test_zmq_to_scheduler_tp1_images_and_video(setup, references, qwen2_5_vl_tiny: Path) -> None:
    """One rank; an image part and a video part (num_parts 2, modality-ordered); Qwen2.5-VL video metadata."""
    prefill, erics = setup
    urls = [image_url(*spec) for spec in IMAGES[:2]]
    video = video_data_url(num_frames=8, width=56, height=56, fps=4, seed=5)
    result = prefill.job(kind="scheduler", model=str(qwen2_5_vl_tiny), backend="zmq_to_scheduler",
                         encoder_urls=[erics["B"].url], images=urls, videos=[video], prompt=prompt_for(2, 1), tp=1,
                         dtype="float32")
    (outcome,) = result.outcomes
    ref = references["qwen2_5_vl"]["images"]
    check_equal(outcome, eric_tensors(erics["B"], urls), (ref[0][:2], ref[1][:2]), torch.float32)
    check_equal(outcome, eric_tensors(erics["B"], [video], "video"), None, torch.float32, modality="VIDEO")
    assert outcome.extra["second_per_grid_ts"] == [1.0]  # temporal_patch_size 2 / Eric's 2 fps sampling
    assert outcome.modalities == ["IMAGE", "IMAGE", "VIDEO"]


def test_request_split_across_two_erics_is_reassembled_in_order(setup, references, qwen2_vl_tiny: Path) -> None:
    prefill, erics = setup
    a, c = erics["A"], erics["C"]
    urls = [image_url(*spec) for spec in SPLIT_IMAGES]
    before = (items_counter(a), items_counter(c))
    result = prefill.job(kind="tokenizer", model=str(qwen2_vl_tiny), backend="zmq_to_tokenizer",
                         encoder_urls=[a.url, c.url], images=urls, prompt=prompt_for(len(urls)))
    assert (items_counter(a) - before[0], items_counter(c) - before[1]) == (2, 2)  # num_parts 2: both Erics
    expected = eric_tensors(a, urls)
    check_equal(result.outcomes[0], expected, references["qwen2_vl"]["split"], torch.float16)
    sched = prefill.job(kind="scheduler", model=str(qwen2_vl_tiny), backend="mooncake", encoder_urls=[c.url, a.url],
                        images=urls, prompt=prompt_for(len(urls)), tp=2)
    for outcome in sched.outcomes:
        check_equal(outcome, expected, references["qwen2_vl"]["split"], torch.float16)


def test_eric_registers_with_sglang_bootstrap(setup, references, qwen2_vl_tiny: Path) -> None:
    """C registered itself (ERIC_SGLANG_REGISTER_URLS); a prefill with no --encoder-urls dispatches to it."""
    prefill, erics = setup
    c = erics["C"]
    deadline = time.monotonic() + 30
    while c.url not in prefill.call(BootstrapUrls(), list[str]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.call(BootstrapUrls(), list[str]) == [c.url]
    urls = [image_url(*spec) for spec in IMAGES]
    result = prefill.job(kind="tokenizer", model=str(qwen2_vl_tiny), backend="zmq_to_tokenizer", encoder_urls=[],
                         images=urls, prompt=prompt_for(len(urls)), use_bootstrap=True)
    check_equal(result.outcomes[0], eric_tensors(c, urls), references["qwen2_vl"]["images"], torch.float16)
    assert httpx.get(c.url + "/health_generate", timeout=60).status_code == 200
    c.stop()  # a graceful stop unregisters
    assert prefill.call(BootstrapUrls(), list[str]) == []


def test_eric_down_or_frozen_fails_like_sglangs_own_encoder(setup, qwen2_vl_tiny: Path, qwen2_5_vl_tiny: Path) -> None:
    """SGLang classifies encoder failures itself (receiver._extract_encoder_error): a refused connection is 502,
    a client timeout 504 "Encoder ... timeout", an encoder's error body gives its status and message. Eric down,
    Eric frozen and Eric refusing bad media land in exactly those places."""
    prefill, erics = setup
    down = f"http://127.0.0.1:{free_port()}"
    urls = [image_url(*spec) for spec in IMAGES[:2]]
    common = {"model": str(qwen2_vl_tiny), "images": urls, "prompt": prompt_for(2)}

    tok = prefill.job(kind="tokenizer", backend="zmq_to_tokenizer", encoder_urls=[down], **common).outcomes[0]
    assert (tok.ok, tok.error_code) == (False, 503)
    assert tok.error_msg.startswith("The encoder did not return multimodal embeddings")

    sched = prefill.job(kind="scheduler", backend="zmq_to_scheduler", encoder_urls=[down], tp=1, **common)
    assert sched.outcomes[0].error_code == 502 and "Cannot connect" in sched.outcomes[0].error_msg

    frozen = erics["B"]
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        res = prefill.job(kind="scheduler", backend="mooncake", encoder_urls=[frozen.url], tp=2,
                          env={"SGLANG_ENCODER_HTTP_TIMEOUT": "3"}, **{**common, "model": str(qwen2_5_vl_tiny)})
        for o in res.outcomes:  # the dispatch (/encode) or the rank's size pull, whichever SGLang saw first
            assert (o.ok, o.error_code) == (False, 504)
            assert re.fullmatch(r"Encoder (HTTP request|/scheduler_receive_meta_data) timeout \(3\.0s\)",
                                o.error_msg), o.error_msg
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)

    bad = {**common, "images": [urls[0], "data:image/png;base64,iVBORw0KGgo="]}
    res = prefill.job(kind="scheduler", backend="zmq_to_scheduler", encoder_urls=[erics["A"].url], tp=2, **bad)
    for o in res.outcomes:
        assert not o.ok and o.error_code == 400 and "item 1" in o.error_msg, (o.error_code, o.error_msg)


def test_adapter_rules_without_servers() -> None:
    """SGLang's --dtype auto rule for the wire dtype, and how SGLang's mm_items become Eric media URLs."""
    from eric_epd.plugins.sglang.adapter import SglangError, item_url, wire_dtype

    assert wire_dtype("auto", {"torch_dtype": "bfloat16"}) == "bfloat16"
    assert wire_dtype("auto", {"dtype": "float32"}) == "float16"
    assert wire_dtype("float32", {"dtype": "bfloat16"}) == "float32"
    assert item_url("https://x/a.png", 0) == "https://x/a.png"
    assert item_url({"url": "data:image/png;base64,AAAA", "content_hash": "h"}, 0) == "data:image/png;base64,AAAA"
    assert item_url("/srv/a.png", 0) == "file:///srv/a.png"
    assert item_url("iVBORw0KGgo=", 0) == "data:application/octet-stream;base64,iVBORw0KGgo="
    with pytest.raises(SglangError, match="max_pixels"):
        item_url({"url": "https://x/a.png", "preprocess_kwargs": None, "max_pixels": 4096}, 3)


def test_documented_eric_command_lines_parse() -> None:
    """The README's `eric-epd serve` lines (with the environment they set) are accepted by Eric's parser."""
    import argparse
    import shlex

    from eric_epd.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    lines = [line.split("#")[0] for line in README.read_text().splitlines() if "eric-epd serve" in line]
    assert len(lines) >= 2
    for line in lines:
        words = shlex.split(line)
        start = words.index("eric-epd")
        assert all("=" in w for w in words[:start])  # only environment assignments before the command
        args = parser.parse_args(words[start + 1:])
        assert args.command == "serve" and args.port == 8100
