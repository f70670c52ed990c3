"""Real SGLang servers on this CPU, tiny Qwen3-VL in float32 (DeepStack rows; a video's timestamps written into the
prompt): `--language-only --encoder-urls <Eric>` answers images and a video with the greedy tokens and logprobs of the
same SGLang serving the checkpoint alone, on a noise-vision copy of the checkpoint; other media's answers fail the
comparisons (tests/support/sglang_served.py; the Qwen2-VL servers of test_sglang_server.py are stopped by then)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eric_epd.stack.process import running
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from tests.support.sglang_served import IMAGES, VIDEOS, Family, family_servers, images, video


@pytest.fixture(scope="module")
def family(qwen3_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("sglang-server-qwen3")
    eric, alone, language_only = family_servers(qwen3_vl_tiny, logs, "qwen3_vl", ("zmq_to_scheduler",))
    with running(eric, alone, *language_only.values()):
        yield Family(eric, alone, language_only)


def test_qwen3_vl_images_and_video_token_for_token(family: Family) -> None:
    """Images and a video through Eric give SGLang alone's answers; other media's answers fail the comparisons."""
    ours = family.through_eric("zmq_to_scheduler", images(IMAGES[0], IMAGES[1]), "image", 2)
    assert_greedy_agree(ours, family.reference("01", images(IMAGES[0], IMAGES[1])), NEAR_TIE_FLOAT32, "images")
    assert_greedy_differ(ours, family.reference("02", images(IMAGES[0], IMAGES[2])), NEAR_TIE_FLOAT32, "images")
    ours = family.through_eric("zmq_to_scheduler", video(VIDEOS[0]), "video", 1)
    assert_greedy_agree(ours, family.reference("v0", video(VIDEOS[0])), NEAR_TIE_FLOAT32, "video")
    assert_greedy_differ(ours, family.reference("v1", video(VIDEOS[1])), NEAR_TIE_FLOAT32, "video")
