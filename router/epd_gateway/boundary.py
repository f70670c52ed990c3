"""The trust boundary: what a client's chat or completion request may carry before anything goes downstream.

Each content part carries only the keys its type allows; client-chosen identifiers (`uuid`) and the fields that
steer the engines' internals are refused with a 400 naming them; client embeddings only where the operator opted
in, checked against their grid and the model's real embedding width (embeds.py)."""

from __future__ import annotations

from typing import Any

from eric_epd.common.errors import ApiError
from eric_epd.common.jsonbody import clip

STEERING_FIELDS = frozenset(
    {
        "kv_transfer_params",
        "ec_transfer_params",
        "vllm_xargs",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "data_parallel_rank",
        "request_id",
        "multi_modal_uuids",
        "prompt_embeds",
        "chat_template",
        # SGLang's: request identity and placement, sessions, raw token ids, adapters, server-side code (dill-unpickled
        # when --enable-custom-logit-processor is on), hidden states out
        "rid",
        "routed_dp_rank",
        "session_params",
        "input_ids",
        "lora_path",
        "custom_logit_processor",
        "custom_params",
        "return_hidden_states",
        "priority",
        # SGLang's processor options (serving_chat.py hands them to its multimodal processor); a top-level
        # use_audio_in_video would also skip the gateway's soundtrack handling, which reads mm_processor_kwargs only
        "images_config",
        "video_config",
        "use_audio_in_video",
        "max_dynamic_patch",
        "min_dynamic_patch",
    }
)
"""Request fields that steer vLLM's or SGLang's internals (KV/EC transfer, processor and media settings, request
identity and placement, sessions, adapters, server-side code): the gateway writes them itself where needed, a client
never does (but for one processor option on chat requests: `audio_in_video`)."""

SAMPLING_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "min_tokens",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "use_beam_search",
        "truncate_prompt_tokens",
        "response_format",
        "structured_outputs",
        "user",
        "echo",
        "add_special_tokens",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "cache_salt",
        # SGLang's sampling and structured-output options
        "regex",
        "ebnf",
        "json_schema",
        "no_stop_trim",
        "separate_reasoning",
        "stream_reasoning",
    }
)
"""What both request kinds may carry: the model, sampling, output and structured-output options of the OpenAI API,
vLLM and SGLang (each engine checks their values)."""
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "include_reasoning",
    "thinking_token_budget",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "documents",
    "mm_processor_kwargs",  # the last: use_audio_in_video only
}
"""The fields a chat request may carry: an allowlist (a field a new engine version adds passes only once listed)."""
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "suffix"}
"""The fields a /v1/completions request may carry."""

PART_KEYS = {
    "text": {"type", "text"},
    "image_url": {"type", "image_url"},
    "video_url": {"type", "video_url"},
    "input_audio": {"type", "input_audio"},
    "audio_url": {"type", "audio_url"},
}
"""Content part types vLLM's chat API accepts for media, and the only keys each may carry."""
EMBED_PARTS = {"image_embeds": {"type", "image_embeds"}, "video_embeds": {"type", "video_embeds"}}
PAYLOAD_KEYS = {
    "image_url": {"url", "detail"},
    "video_url": {"url"},
    "audio_url": {"url"},
    "input_audio": {"data", "format"},
}
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"})


AUDIO_IN_VIDEO = "use_audio_in_video"
"""The one processor option a chat request may carry (`mm_processor_kwargs`): its videos bring their soundtracks."""


def check_request_fields(body: dict[str, Any], chat: bool = False) -> None:
    """400 for a field outside the allowlist (CHAT_FIELDS, COMPLETION_FIELDS), naming it; one that only the
    gateway may write (STEERING_FIELDS) says so (a chat request may set `audio_in_video`'s one option)."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:  # a steering field is named as such, whatever else the request carries
        if chat and name == "mm_processor_kwargs":
            audio_in_video(body)
        elif name in STEERING_FIELDS:
            raise ApiError(
                400,
                f"the request field '{name}' is not accepted: it steers the engine's internals "
                "and only the gateway sets it",
                param=name,
            )
    if body.get("stream") is not None and not isinstance(body["stream"], bool):  # "false": truthy here, False there
        raise ApiError(400, f"'stream' must be true or false, got {clip(body['stream'])}", param="stream")
    if body.get("use_beam_search"):
        raise ApiError(
            400,
            "use_beam_search is not accepted: vLLM's beam search builds its own sampling parameters, which drop the "
            "prefill/decode hand-off and the encoder's handles the gateway adds",
            param="use_beam_search",
        )
    for name in body:
        if name not in allowed:
            shown = str(name)[:64]
            raise ApiError(
                400,
                f"the request field '{shown}' is not accepted: the gateway passes on only the "
                "model, messages or prompt, sampling and output options",
                param=shown,
            )


def audio_in_video(body: dict[str, Any]) -> bool:
    """A chat request's `mm_processor_kwargs`: absent, or exactly {"use_audio_in_video": <bool>} (vLLM's option that
    gives each video's soundtrack to the model too); 400 for any other processor option."""
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return False
    if not isinstance(kwargs, dict) or set(kwargs) != {AUDIO_IN_VIDEO} or not isinstance(kwargs[AUDIO_IN_VIDEO], bool):
        raise ApiError(
            400,
            f"the request field 'mm_processor_kwargs' may only be {{\"{AUDIO_IN_VIDEO}\": true}}: "
            "other processor options steer the engine's internals",
            param="mm_processor_kwargs",
        )
    return kwargs[AUDIO_IN_VIDEO]


def drop_inert_audio_in_video(body: dict[str, Any], has_video: bool) -> bool:
    """Remove `mm_processor_kwargs` where it changes nothing the engine computes: `use_audio_in_video` false (vLLM's
    default), or true in a request without a video. vLLM hashes a request's processor options into every item's
    identifier, so forwarded it would rename items whose Eric handles are keyed by content. Whether it was removed."""
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None or (kwargs.get(AUDIO_IN_VIDEO) and has_video):
        return False
    del body["mm_processor_kwargs"]
    return True


def check_messages(body: dict[str, Any], allow_embeddings: bool) -> None:
    """Every message and content part carries only the keys its type allows (see PART_KEYS)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    allowed = PART_KEYS | EMBED_PARTS if allow_embeddings else PART_KEYS
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{m}] must be an object", param="messages")
        _only(message, MESSAGE_KEYS, f"messages[{m}]")
        content = message.get("content")
        if isinstance(content, list):
            for p, part in enumerate(content):
                _check_part(part, allowed, f"messages[{m}].content[{p}]")
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{m}].content must be a string or a list of parts", param="messages")


def _check_part(part: Any, allowed: dict[str, set[str]], where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in allowed:  # a list or an object is no type (nor hashable)
        hint = " (client embeddings are off on this gateway)" if isinstance(kind, str) and kind in EMBED_PARTS else ""
        raise ApiError(
            400,
            f"{where}: unsupported content part type {clip(kind)}{hint}; supported: {sorted(allowed)}",
            param="messages",
        )
    if "uuid" in part:
        raise ApiError(
            400,
            f"{where}: 'uuid' is not accepted: multimodal identifiers are minted by the gateway "
            "from the content it sees",
            param="uuid",
        )
    _only(part, allowed[kind], where)
    payload = part.get(kind)
    if kind in PAYLOAD_KEYS and isinstance(payload, dict):
        _only(payload, PAYLOAD_KEYS[kind], f"{where}.{kind}")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise ApiError(400, f"{where}: a text part needs a string 'text'", param="messages")


def _only(obj: dict[str, Any], keys: set[str] | frozenset[str], where: str) -> None:
    extra = sorted(str(k)[:64] for k in obj if k not in keys)
    if extra:
        raise ApiError(400, f"{where}: unexpected field(s) {extra}; allowed: {sorted(keys)}", param=extra[0])
