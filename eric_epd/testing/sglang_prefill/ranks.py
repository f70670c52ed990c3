"""SGLang's scheduler side in the prefill host: TP ranks (forked, SGLang's gloo TP group) running MMReceiverHTTP."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import msgspec
import torch

from eric_epd.testing.sglang_prefill.messages import Outcome, RankEvent, RankJob, Stop, pack


def outcome_from_mm(mm: Any, captured: dict[str, Any], rank: int = -1, engine: str = "") -> Outcome:
    """The outcome of a receiver that got its multimodal inputs: embeddings, ids, M-RoPE, grids and extras."""
    return Outcome(
        ok=True,
        embeddings=[pack(i.precomputed_embeddings) for i in mm.mm_items],
        modalities=[i.modality.name for i in mm.mm_items],
        input_ids=[int(x) for x in mm.input_ids],
        mrope=pack(mm.mrope_positions) if mm.mrope_positions is not None else None,
        rank=rank,
        engine=engine,
        **captured_fields(captured),
    )


def outcome_of_failure(
    message: str, code: int | None, captured: dict[str, Any], rank: int = -1, engine: str = ""
) -> Outcome:
    """The outcome of an aborted request, with what the receiver handed SGLang's processor if it got that far."""
    received = {m.name: pack(t) for m, t in (captured.get("embeddings") or {}).items() if t is not None}
    return Outcome(
        ok=False,
        error_msg=message,
        error_code=code,
        received=received,
        rank=rank,
        engine=engine,
        **captured_fields(captured),
    )


def captured_fields(captured: dict[str, Any]) -> dict[str, Any]:
    """Outcome's grid, audio_feature_lens and extra fields from the kwargs the receiver handed the processor."""
    grid = {k: v.tolist() for k, v in captured.items() if k.endswith("grid_thw") and v is not None}
    extra = {k: [float(x) for x in v] for k, v in captured.items() if k == "second_per_grid_ts" and v is not None}
    if captured.get("video_timestamps") is not None:  # one list per video: flattened, in order
        extra["video_timestamps"] = [float(x) for video in captured["video_timestamps"] for x in video]
    lens = captured.get("audio_feature_lens")
    return {
        "grid": grid,
        "extra": extra,
        "audio_feature_lens": [int(x) for x in lens.flatten()] if lens is not None else [],
    }


def spy_grids(mm_processor: Any, captured: dict[str, Any]) -> None:
    """Record the kwargs the receiver hands SGLang's processor (grids, video metadata) and, as "embeddings", the
    rows by modality; behaviour unchanged."""
    real = mm_processor.get_validated_mm_data

    def spy(prompt: Any, embeddings: Any, **kwargs: Any) -> Any:
        captured.update(kwargs, embeddings={m: t.detach().clone() for m, t in embeddings.items()})
        return real(prompt, embeddings, **kwargs)

    mm_processor.get_validated_mm_data = spy


def server_args(job_model: str, backend: str, urls: list[str], tp: int, dtype: str, model_impl: str = "auto") -> Any:
    """SGLang's resolved server arguments of a CPU language-only prefill using these encoders (the hybrid Qwen3.5
    models' radix cache without state snapshots, which SGLang's CPU platform lacks: "extra_buffer requires platform
    support for Mamba cache state snapshots", and so without the overlap schedule; GPUs resolve "auto" to extra_buffer;
    the receivers are the same)."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=job_model,
        language_only=True,
        encoder_urls=urls,
        encoder_transfer_backend=backend,
        device="cpu",
        host="127.0.0.1",
        tp_size=tp,
        dtype=dtype,
        mamba_radix_cache_strategy="no_buffer",
        disable_overlap_schedule=True,
        model_impl=model_impl,
    )
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


def rank_main(conn: Any, world_rank: int, tp: int, port: int) -> None:
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
        restore_env(saved_env)
        conn.send_bytes(msgspec.msgpack.encode(outcome))


def _rank_job(
    cmd: RankJob, world_rank: int, tp: int, port: int, conn: Any, decoder: Any, pools: dict[int, Any]
) -> Outcome:
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
    args = server_args(cmd.model, cmd.backend, cmd.encoder_urls, tp, cmd.dtype, cmd.model_impl)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=0))
    if not torch.distributed.is_initialized():  # SGLang's own TP group, on gloo
        parallel_state.init_distributed_environment(
            world_size=tp,
            rank=world_rank,
            local_rank=world_rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel()
    scheduler = FakeSchedulerStandIn(args)  # as Scheduler.__init__: create_mm_receiver(model_config.dtype, ...)
    receiver = MMReceiverHTTP(
        args, dtype=scheduler.model_config.dtype, hf_config=scheduler.model_config.hf_config, scheduler=scheduler
    )
    engine = getattr(receiver, "embeddings_engine", None)
    if engine is not None:
        if id(engine) not in pools:
            pools[id(engine)] = _cpu_landing_pool(engine)
        receiver.embedding_pool = pools[id(engine)]
    captured: dict[str, Any] = {}
    spy_grids(receiver.mm_processor, captured)
    req = TokenizedGenerateReqInput(
        rid=cmd.rid,
        input_text=cmd.prompt,
        input_ids=None,
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        need_wait_for_mm_inputs=True,
        num_items_assigned={Modality[k]: v for k, v in cmd.num_items_assigned.items()},
        encoder_urls=cmd.encoder_urls,
    )
    engine_name = type(engine).__name__ if engine is not None else ""
    pending: list[Any] = [req]
    deadline = time.monotonic() + cmd.timeout_s
    while True:
        while conn.poll(0):
            event = decoder.decode(conn.recv_bytes())
            if isinstance(event, RankEvent):
                pending.append(
                    EncoderDispatchErrorReq(rid=event.rid, error_msg=event.error_msg, error_code=event.error_code)
                )
        ready, aborts = receiver.process_waiting_requests(pending)
        pending = []
        if ready:
            return outcome_from_mm(ready[0].mm_inputs, captured, world_rank, engine_name)
        if aborts:
            _, message, code = aborts[0]
            return outcome_of_failure(str(message), int(code) if code else None, captured, world_rank, engine_name)
        if time.monotonic() > deadline:
            return Outcome(ok=False, error_msg="harness: no outcome in time", rank=world_rank)
        time.sleep(0.005)


def restore_env(saved: dict[str, str | None]) -> None:
    """Put back the environment variables `saved` holds (None: unset)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
