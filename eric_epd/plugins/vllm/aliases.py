"""The identifiers vLLM 0.32 gives a request's items when it carries `use_audio_in_video` (a processor option, so
every item is named by a hash of its uuid and the options, and a video's soundtrack by the video's uuid: the gateway's
soundtrack_uuid of the pair), mapped to the Eric handles that hold their rows."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import soundtrack_uuid

logger = logging.getLogger(__name__)

AUDIO_IN_VIDEO = {"use_audio_in_video": True}
"""The mm_processor_kwargs of a request whose videos bring their soundtracks (the gateway sends no other option)."""
MODALITIES = ("image", "video", "audio")


def vllm_identifier(algorithm: str, model_id: str, modality: str, uuid: str) -> str:
    """vLLM's `ProcessorInputs.get_mm_hashes` for an item given `uuid` in a request whose mm_processor_kwargs are
    AUDIO_IN_VIDEO (no media_io_kwargs): its hash of the model, the uuid under its modality, and the options."""
    from vllm.multimodal.hasher import MultiModalHasher

    return MultiModalHasher.hash_kwargs(
        algorithm,
        model_id=model_id,
        **{modality: uuid},  # type: ignore[arg-type]
        mm_processor_kwargs=dict(AUDIO_IN_VIDEO),
    )


def audio_in_video_offers(
    offered: Mapping[str, EmbeddingHandle], soundtracks: Sequence[tuple[str, str]], algorithm: str, model_id: str
) -> dict[str, EmbeddingHandle]:
    """`offered` (hash -> handle) keyed as vLLM names the items of a `use_audio_in_video` request: each handle under
    its identifier as an item of any modality; each video with its soundtrack (`soundtracks`: (video hash, audio
    hash) pairs) under the identifier of its uuid (soundtrack_uuid of the pair), and the soundtrack under the
    identifier of the audio vLLM takes from that video (its uuid the video's)."""
    keyed = {
        vllm_identifier(algorithm, model_id, modality, key): handle
        for key, handle in offered.items()
        for modality in MODALITIES
    }
    for video, audio in soundtracks:
        uuid = soundtrack_uuid(video, audio)
        keyed[vllm_identifier(algorithm, model_id, "video", uuid)] = offered[video]
        keyed[vllm_identifier(algorithm, model_id, "audio", uuid)] = offered[audio]
    return keyed
