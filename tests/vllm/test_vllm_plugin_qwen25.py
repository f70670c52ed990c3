"""Qwen2.5-VL (windowed vision attention) behind Eric in real vLLM: greedy tokens equal vLLM's own encoder's,
for images and a video (whose M-RoPE spacing in time comes from its sampled fps), up to the first near tie."""

from __future__ import annotations

from pathlib import Path

from eric_epd.stack.servers import EricServer
from eric_epd.testing.exactness import NEAR_TIE_FLOAT32, assert_greedy_agree, assert_greedy_differ
from eric_epd.testing.vllm_cases import (
    CASES,
    Case,
    encode_case,
    epd_prompt,
    eric_key_in_env,
    greedy_run,
    llm_kwargs,
    raw_prompt,
)

CASES_RUN = ("two_images", "four_images", "one_video")


def test_qwen25_epd_tokens_equal_monolithic(qwen2_5_vl_tiny: Path, tmp_path: Path) -> None:
    """The reference is the same engine given the raw images: the connector declines identifiers that are not
    Eric hashes, so vLLM runs its own Qwen2.5-VL vision encoder on them, exactly as a monolithic vLLM does. Negative
    control: the four images' EPD answer fails the same comparison with its answer for four other images of the same
    sizes."""
    from vllm import LLM
    from vllm.config import ECTransferConfig

    with EricServer(qwen2_5_vl_tiny, tp=2, log_path=tmp_path / "eric.log") as eric, eric_key_in_env(eric.api_key):
        ec = ECTransferConfig(
            ec_connector="EricECConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_connector_extra_config={"eric_urls": [eric.url], "backends": ["shm"]},
        )
        llm = LLM(**llm_kwargs(qwen2_5_vl_tiny), ec_transfer_config=ec, disable_log_stats=False)
        epd = {}
        for case in (c for c in CASES if c.name in CASES_RUN):
            monolithic = greedy_run(llm, raw_prompt(case, video_metadata=True))
            items = encode_case(eric.url, case, eric.api_key)
            if case.video_frames:  # 8 frames at 4 fps sampled at 2 fps: the 1 s per grid step vLLM assumes
                assert [i["second_per_grid_ts"] for i in items if i["modality"] == "video"] == [1.0]
            epd[case.name] = greedy_run(llm, epd_prompt(case, items), items)
            assert_greedy_agree(epd[case.name], monolithic, NEAR_TIE_FLOAT32, case.name)
        counters = {m.name: m.value for m in llm.get_metrics() if "eric_ec" in m.name}
        assert counters["vllm:eric_ec_loaded_items"] == 7  # 2 + 4 images and the video came from Eric
        assert counters["vllm:eric_ec_local_encoder_items"] == 7  # the raw-media runs used vLLM's encoder
        four = next(c for c in CASES if c.name == "four_images")
        wrong = greedy_run(llm, raw_prompt(Case("four_other_images", four.image_sizes, seed=43)))
        assert_greedy_differ(epd["four_images"], wrong, NEAR_TIE_FLOAT32, "four_images against other images' answer")
        del llm
