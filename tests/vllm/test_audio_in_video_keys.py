"""The keys the connector gives the Eric handles of a `use_audio_in_video` request are the identifiers vLLM 0.32's
own processor inputs give its items (each item of the request, and the soundtrack vLLM takes from a video under that
video's uuid); the soundtrack pairs in `vllm_xargs` are checked against the request's handles."""

from __future__ import annotations

import pytest
from vllm.multimodal.processing.inputs import ProcessorInputs

from eric_epd.plugins.vllm.aliases import AUDIO_IN_VIDEO, audio_in_video_offers
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import HandleError, offered_soundtracks, soundtracks_xargs

MODEL = "/models/omni"
VIDEO, SOUND, IMAGE = "a" * 64, "b" * 64, "c" * 64


class _Items(list):
    """A modality's items as get_mm_hashes reads them (their data is not hashed where a uuid is given)."""

    def get_all_items_for_hash(self) -> list:
        return list(self)


def _handle(key: str) -> EmbeddingHandle:
    return EmbeddingHandle(key, (4, 64), "float32", 1024, "http://eric", "i", f"http://eric/{key}")


def test_each_handle_is_keyed_as_vllm_names_its_item() -> None:
    """vLLM's hashes of a request with a video (uuid VIDEO), the audio it takes from it (uuid VIDEO too, as its chat
    parser gives it) and an image: the video's handle, the soundtrack's and the image's, in that order."""
    inputs = ProcessorInputs(
        [],
        {"video": _Items([None]), "audio": _Items([None]), "image": _Items([None])},
        {"video": [VIDEO], "audio": [VIDEO], "image": [IMAGE]},
        hf_processor_mm_kwargs=dict(AUDIO_IN_VIDEO),
    )
    hashes = inputs.get_mm_hashes(MODEL, "blake3")
    offered = {k: _handle(k) for k in (VIDEO, SOUND, IMAGE)}
    keyed = audio_in_video_offers(offered, {VIDEO: SOUND}, "blake3", MODEL)
    assert [keyed[hashes[m][0]].hash for m in ("video", "audio", "image")] == [VIDEO, SOUND, IMAGE]
    assert not set(offered) & set(keyed)  # the plain hashes name nothing in such a request


def test_soundtrack_pairs_must_name_the_requests_handles() -> None:
    args = soundtracks_xargs({VIDEO: SOUND})
    assert offered_soundtracks(args, {VIDEO, SOUND}) == {VIDEO: SOUND}
    assert offered_soundtracks({}, {VIDEO}) == {} and soundtracks_xargs({}) == {}
    with pytest.raises(HandleError, match="not both among"):
        offered_soundtracks(args, {VIDEO})
    with pytest.raises(HandleError, match="not a JSON object"):
        offered_soundtracks({"eric_soundtracks": "[1]"}, {VIDEO, SOUND})
