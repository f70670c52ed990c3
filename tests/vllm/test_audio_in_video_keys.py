"""The keys the connector gives the Eric handles of a `use_audio_in_video` request are the identifiers vLLM 0.32's
own processor inputs give its items (each item of the request, and the soundtrack vLLM takes from a video under that
video's uuid, which the gateway mints from both hashes: two videos of the same frames with other soundtracks are two
items to vLLM); the soundtrack pairs in `vllm_xargs` are checked against the request's handles."""

from __future__ import annotations

import pytest
from vllm.multimodal.processing.inputs import ProcessorInputs

from eric_epd.plugins.vllm.aliases import AUDIO_IN_VIDEO, audio_in_video_offers
from eric_epd.wire.handles import EmbeddingHandle
from eric_epd.wire.handoff import HandleError, offered_soundtracks, soundtrack_uuid, soundtracks_xargs

MODEL = "/models/omni"
VIDEO, SOUND, IMAGE, OTHER_SOUND = "a" * 64, "b" * 64, "c" * 64, "d" * 64


class _Items(list):
    """A modality's items as get_mm_hashes reads them (their data is not hashed where a uuid is given)."""

    def get_all_items_for_hash(self) -> list:
        return list(self)


def _handle(key: str) -> EmbeddingHandle:
    return EmbeddingHandle(key, (4, 64), "float32", 1024, "http://eric", "i", f"http://eric/{key}")


def _vllm_hashes(video_uuid: str) -> dict[str, list[str]]:
    """vLLM's hashes of a request with a video (uuid `video_uuid`), the audio it takes from it (the same uuid, as its
    chat parser gives it) and an image (uuid IMAGE)."""
    inputs = ProcessorInputs(
        [],
        {"video": _Items([None]), "audio": _Items([None]), "image": _Items([None])},
        {"video": [video_uuid], "audio": [video_uuid], "image": [IMAGE]},
        hf_processor_mm_kwargs=dict(AUDIO_IN_VIDEO),
    )
    return inputs.get_mm_hashes(MODEL, "blake3")


def test_each_handle_is_keyed_as_vllm_names_its_item() -> None:
    """The video sent with its soundtrack under the gateway's uuid: the video's handle, the soundtrack's and the
    image's, in that order."""
    hashes = _vllm_hashes(soundtrack_uuid(VIDEO, SOUND))
    offered = {k: _handle(k) for k in (VIDEO, SOUND, IMAGE)}
    keyed = audio_in_video_offers(offered, [(VIDEO, SOUND)], "blake3", MODEL)
    assert [keyed[hashes[m][0]].hash for m in ("video", "audio", "image")] == [VIDEO, SOUND, IMAGE]
    assert not set(offered) & set(keyed)  # the plain hashes name nothing in such a request


def test_the_same_frames_with_another_soundtrack_are_other_items_to_vllm() -> None:
    """A video of the same frames (its content hash is of the frames) with another soundtrack: every identifier vLLM
    gives the video and its soundtrack differs, so none of vLLM's caches hands one client's soundtrack to another."""
    ours, theirs = (_vllm_hashes(soundtrack_uuid(VIDEO, sound)) for sound in (SOUND, OTHER_SOUND))
    for modality in ("video", "audio"):
        assert ours[modality] != theirs[modality], modality
    # both in one request: each soundtrack under its own video's identifier (pairs keyed by the video's hash alone
    # kept only one of them)
    offered = {k: _handle(k) for k in (VIDEO, SOUND, OTHER_SOUND)}
    both = audio_in_video_offers(offered, [(VIDEO, SOUND), (VIDEO, OTHER_SOUND)], "blake3", MODEL)
    assert both[ours["audio"][0]].hash == SOUND and both[theirs["audio"][0]].hash == OTHER_SOUND


def test_soundtrack_pairs_must_name_the_requests_handles() -> None:
    args = soundtracks_xargs([(VIDEO, SOUND), (VIDEO, OTHER_SOUND)])
    assert offered_soundtracks(args, {VIDEO, SOUND, OTHER_SOUND}) == [(VIDEO, SOUND), (VIDEO, OTHER_SOUND)]
    assert offered_soundtracks({}, {VIDEO}) == [] and soundtracks_xargs([]) == {}
    with pytest.raises(HandleError, match="not both among"):
        offered_soundtracks(args, {VIDEO, SOUND})
    with pytest.raises(HandleError, match="not a JSON list"):
        offered_soundtracks({"eric_soundtracks": "[1]"}, {VIDEO, SOUND})
