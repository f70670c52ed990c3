"""A stand-in SGLang prefill host for tests: SGLang 0.5.23's own receiver classes, imported from the installed
sglang (never copied), driven as its TokenizerManager and Scheduler drive them, against live Erics.

SGLang cannot run a model on this CPU, so the prefill side runs in a spawned "prefill host" process (host.py) that
does what SGLang's TokenizerManager and Scheduler do around their encoder receivers: ServerArgs + resolution +
publish, load_plugins() (eric_epd's entry point), EncoderBootstrapServer, create_mm_receiver, send_encode_request /
recv_mm_data on the tokenizer side, and TP scheduler ranks (ranks.py: forked processes joined by SGLang's own gloo
TP group) that call MMReceiverHTTP.process_waiting_requests with TokenizedGenerateReqInput until the request is
ready or aborted. The multimodal processor that lays the embeddings out (input_ids, offsets, M-RoPE) is SGLang's
real one for the checkpoint (QwenVLImageProcessor, Qwen2AudioMultimodalProcessor, ...). Stand-ins, for the model
runner only: `FakeSchedulerStandIn` (the attributes the receiver reads off the Scheduler) and
`CpuLandingPoolStandIn` (SGLang's EmbeddingPool with its landing buffer in host memory instead of cuda:N; its
allocator and the RDMA landing logic are SGLang's). SGLang's own local reference (local_reference.py) loads audio
clips with `load_audio_stand_in` (its soundfile fallback without the torchaudio import this machine lacks; no
resampling).
"""

from eric_epd.testing.sglang_prefill.host import Prefill
from eric_epd.testing.sglang_prefill.messages import (
    Bootstrap,
    BootstrapUrls,
    JobResult,
    Outcome,
    ParseArgs,
    ParsedArgs,
    WireCheck,
    unpack,
)

__all__ = [
    "Bootstrap",
    "BootstrapUrls",
    "JobResult",
    "Outcome",
    "ParseArgs",
    "ParsedArgs",
    "Prefill",
    "WireCheck",
    "unpack",
]
