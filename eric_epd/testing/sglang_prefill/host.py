"""The spawned prefill host (SGLang's tokenizer-manager side and the rank groups) and the test's handle on it."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import msgspec
import torch

from eric_epd.stack.process import free_port
from eric_epd.testing.sglang_prefill.kimi import as_sglang_sees_it, stand_in_remote_processors
from eric_epd.testing.sglang_prefill.local_reference import local_outcome
from eric_epd.testing.sglang_prefill.messages import (
    Bootstrap,
    Command,
    Job,
    JobResult,
    Outcome,
    ParseArgs,
    ParsedArgs,
    RankEvent,
    RankJob,
    RunJob,
    Stop,
    WireCheck,
)
from eric_epd.testing.sglang_prefill.ranks import outcome_from_mm, rank_main, restore_env, server_args, spy_grids

PREFILL_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",  # receivers advertise loopback (the machine's NIC address would also do)
    "MC_LOG_LEVEL": "ERROR",
    "SGLANG_EMBEDDING_POOL_SIZE_MB": "0",  # no cuda pool; the ranks get CpuLandingPoolStandIn instead
    "TOKENIZERS_PARALLELISM": "false",
}


class PrefillHost:
    """Runs in the spawned prefill process: the tokenizer-manager side and the rank groups."""

    def __init__(self) -> None:
        import sglang.srt.managers.tokenizer_manager  # noqa: F401  (imported as the real prefill would)
        from sglang.srt.plugins import load_plugins

        load_plugins()  # discovers eric_epd's `sglang.srt.plugins` entry point and applies its hooks
        stand_in_remote_processors()  # the receivers load their processor themselves (Kimi-K2.5: remote code)
        ctx = multiprocessing.get_context("fork")  # after the imports and hooks, before any thread starts
        self.groups: dict[int, list[Any]] = {}
        for tp in (1, 2):
            port, conns = free_port(), []
            for rank in range(tp):
                parent, child = ctx.Pipe()
                ctx.Process(target=rank_main, args=(child, rank, tp, port), daemon=True).start()
                conns.append(parent)
            self.groups[tp] = conns
        self.bootstrap: Any = None
        self.bootstrap_urls: list[str] = []
        self._send_lock = threading.Lock()

    def parse(self, argv: list[str]) -> ParsedArgs:
        """SGLang's own parsing of a prefill command line, and what it resolved (or the error it raised)."""
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
        return ParsedArgs(
            language_only=d.language_only,
            encoder_only=d.encoder_only,
            encoder_urls=raw[1],
            encoder_transfer_backend=raw[0],
            resolved_backend=d.encoder_transfer_backend,
            encoder_register_urls=raw[2],
            encoder_bootstrap_port=d.encoder_bootstrap_port,
            tp_size=args.tp_size,
            nixl_env=os.environ.get(plugin.ENV, ""),
        )

    def wire_check(self) -> str:
        """Eric's part message, read by SGLang's SafeUnpickler, against the EmbeddingData SGLang's encoder sends."""
        from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
        from sglang.srt.multimodal.modality import Modality
        from sglang.srt.utils.common import safe_pickle_loads

        from eric_epd.wire.sglang import EmbeddingPart, embedding_data_pickle

        theirs = EmbeddingData(
            "r_local_part_1", 2, 1, torch.tensor([[1, 4, 6]]), Modality.IMAGE, torch.zeros(6, 32)
        ).copy_without_embedding()
        ours = safe_pickle_loads(
            embedding_data_pickle(
                EmbeddingPart(
                    req_id="r_local_part_1",
                    num_parts=2,
                    part_idx=1,
                    modality="IMAGE",
                    grid=[[1, 4, 6]],
                    dtype="float32",
                    shape=[6, 32],
                )
            )
        )
        a, b = dict(vars(theirs)), dict(vars(ours))
        if (
            type(ours) is not EmbeddingData
            or torch.as_tensor(b.pop("grid_dim")).tolist() != a.pop("grid_dim").tolist()
            or a != b
        ):
            return f"mismatch: SGLang {vars(theirs)} vs Eric {vars(ours)}"
        theirs = EmbeddingData(
            "a_local_part_0", 1, 0, torch.tensor([3000, 1207]), Modality.AUDIO, torch.zeros(9, 32)
        ).copy_without_embedding()  # audio_feature_lens_raw, int64
        ours = safe_pickle_loads(
            embedding_data_pickle(
                EmbeddingPart(
                    req_id="a_local_part_0",
                    num_parts=1,
                    part_idx=0,
                    modality="AUDIO",
                    grid=[3000, 1207],
                    dtype="float32",
                    shape=[9, 32],
                )
            )
        )
        a, b = dict(vars(theirs)), dict(vars(ours))
        ga, gb = a.pop("grid_dim"), b.pop("grid_dim")
        if not (isinstance(gb, torch.Tensor) and gb.dtype == ga.dtype and torch.equal(ga, gb)) or a != b:
            return f"audio mismatch: SGLang {vars(theirs)} vs Eric {vars(ours)}"
        err = safe_pickle_loads(
            embedding_data_pickle(
                EmbeddingPart(
                    req_id="e",
                    num_parts=1,
                    part_idx=0,
                    modality="VIDEO",
                    grid=None,
                    dtype=None,
                    shape=None,
                    error_msg="bad",
                    error_code=400,
                )
            )
        )
        ref = EmbeddingData("e", 1, 0, None, Modality.VIDEO, error_msg="bad", error_code=400).copy_without_embedding()
        return "ok" if vars(err) == vars(ref) else f"error mismatch: {vars(ref)} vs {vars(err)}"

    def start_bootstrap(self, port: int) -> None:
        """Start SGLang's encoder bootstrap server on `port`, sharing the tokenizer side's URL list."""
        from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

        self.bootstrap = EncoderBootstrapServer(
            "127.0.0.1", port, urls=self.bootstrap_urls, health_check_interval=2.0, health_check_timeout=10.0
        )

    def _tokenizer_side(self, job: Job) -> tuple[Any, Any]:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.encoder.receiver import create_mm_receiver
        from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
        from sglang.srt.multimodal.transport import determine_tensor_transport_mode
        from sglang.srt.runtime_context import publish
        from sglang.srt.utils.hf_transformers_utils import get_processor

        from eric_epd.plugins.sglang import plugin

        os.environ.pop(plugin.ENV, None)
        args = server_args(
            job.model, job.backend, [] if job.use_bootstrap else job.encoder_urls, job.tp, job.dtype, job.model_impl
        )
        publish(args, role="tokenizer")
        model_config = ModelConfig.from_server_args(args)
        import_processors("sglang.srt.multimodal.processors")
        mm_processor = get_mm_processor(
            model_config.hf_config,
            args,
            as_sglang_sees_it(get_processor(job.model)),
            determine_tensor_transport_mode(),
            model_config=model_config,
        )
        # As TokenizerManager: the receiver shares the bootstrap server's URL list (pre-filled by --encoder-urls).
        urls = self.bootstrap_urls if job.use_bootstrap else list(job.encoder_urls)
        receiver = create_mm_receiver(
            args, dtype=model_config.dtype, hf_config=model_config.hf_config, encode_urls=urls
        )
        return mm_processor, receiver

    def run(self, job: Job) -> JobResult:
        """Run one job with its environment variables set, restoring the environment after."""
        saved = {k: os.environ.get(k) for k in job.env}
        os.environ.update(job.env)
        try:
            return self._run(job)
        finally:
            restore_env(saved)

    def _run(self, job: Job) -> JobResult:
        from sglang.srt.managers.io_struct import GenerateReqInput

        mm_processor, receiver = self._tokenizer_side(job)
        obj = GenerateReqInput(
            text=job.prompt, image_data=job.images or None, video_data=job.videos or None, audio_data=job.audios or None
        )
        obj.rid = uuid.uuid4().hex
        if job.kind == "tokenizer":
            return self._run_tokenizer(job, obj, mm_processor, receiver)
        ranks = self.groups[job.tp]
        errors: list[str] = []

        def on_dispatch_error(err: Any) -> None:  # TokenizerManager forwards this to the scheduler
            errors.append(f"{err.error_code} {err.error_msg}")
            event = msgspec.msgpack.encode(
                RankEvent(rid=err.rid, error_msg=err.error_msg, error_code=int(err.error_code))
            )
            with self._send_lock:
                for conn in ranks:
                    conn.send_bytes(event)

        ready = receiver.send_encode_request(obj, on_dispatch_error=on_dispatch_error)
        assert ready is not None, "the tokenizer did not dispatch to an encoder"
        rank_job = msgspec.msgpack.encode(
            RankJob(
                model=job.model,
                backend=job.backend,
                encoder_urls=list(obj.encoder_urls),
                rid=obj.rid,
                prompt=job.prompt,
                num_items_assigned={m.name: list(v) for m, v in obj.num_items_assigned.items()},
                env=job.env,
                dtype=job.dtype,
                timeout_s=job.timeout_s,
                model_impl=job.model_impl,
            )
        )
        with self._send_lock:
            for conn in ranks:
                conn.send_bytes(rank_job)
        ready.set()  # the tokenized request is with the scheduler
        outcomes = [msgspec.msgpack.decode(conn.recv_bytes(), type=Outcome) for conn in ranks]
        return JobResult(outcomes=outcomes, dispatch_error=errors[0] if errors else None)

    def _run_tokenizer(self, job: Job, obj: Any, mm_processor: Any, receiver: Any) -> JobResult:
        from fastapi import HTTPException
        from sglang.srt.managers.tokenizer_manager import _reject_missing_dispatched_encoder_embedding

        captured: dict[str, Any] = {}
        spy_grids(mm_processor, captured)
        obj.need_wait_for_mm_inputs = True  # what TokenizerManager sets when it dispatches to encoders
        mm = asyncio.run(receiver.recv_mm_data(obj, mm_processor, job.prompt, need_wait_for_mm_inputs=True))
        if mm is None:
            try:  # what TokenizerManager does with a missing dispatched embedding
                _reject_missing_dispatched_encoder_embedding(obj, mm)
                outcome = Outcome(ok=False, error_msg="not rejected")
            except HTTPException as e:
                outcome = Outcome(ok=False, error_msg=str(e.detail), error_code=e.status_code)
        else:
            outcome = outcome_from_mm(mm, captured)
        local = None
        if job.local_reference:  # SGLang's own, non-disaggregated path: its HF preprocessing and placement
            local = local_outcome(job, mm_processor)
        return JobResult(outcomes=[outcome], local=local)

    def serve(self, conn: Any) -> None:
        """Answer the test process's commands over `conn` until a `Stop`."""
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
        """The reply to one command (a `Stop` also stops the ranks and the bootstrap server)."""
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
        """Wait for the host's "ready"; raise with its error if it failed to start."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError("prefill host not ready")
        first = self.conn.recv_bytes()
        if first != b"ready":
            raise RuntimeError(msgspec.msgpack.decode(first))

    def call(self, cmd: Any, reply: Any = Any, timeout_s: float = 300.0) -> Any:
        """Send `cmd` and return the host's reply converted to `reply`; a harness error is raised here."""
        self.conn.send_bytes(msgspec.msgpack.encode(cmd))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"prefill host did not answer {type(cmd).__name__}")
        raw = msgspec.msgpack.decode(self.conn.recv_bytes())
        if isinstance(raw, str) and raw.startswith("HARNESS ERROR"):
            raise RuntimeError(raw)
        return msgspec.convert(raw, reply)

    def job(self, **kwargs: Any) -> JobResult:
        """Run a `Job` built from `kwargs` and return its result."""
        return self.call(RunJob(Job(**kwargs)), JobResult)

    def stop(self) -> None:
        """Tell the host to stop, then join it (killed if it has not exited within 10 s)."""
        try:
            self.conn.send_bytes(msgspec.msgpack.encode(Stop()))
            self.conn.poll(20)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
