"""A stand-in for the hub's remote-code Kimi-K2.5 processor, which SGLang's Kimi processor is written against and
which cannot be fetched here: the checkpoint's own tokenizer and image processor, and the `media_processor` face
SGLang reads (the released `media_proc_cfg`, and the token count per image)."""

from __future__ import annotations

from typing import Any


class KimiMediaProcessorStandIn:
    """What SGLang reads off the remote processor's `media_processor`: `media_proc_cfg` and
    `media_tokens_calculator` (the same resize arithmetic as transformers' and vLLM's Kimi processors)."""

    def __init__(self, image_processor: Any) -> None:
        self.media_proc_cfg: dict[str, Any] = dict(image_processor.media_proc_cfg)
        self._image_processor = image_processor

    def media_tokens_calculator(self, media: dict[str, Any]) -> int:
        """Tokens of one {"type": "image", "image": PIL image}: its patches after Kimi's resize, merged."""
        image = media["image"]
        patches = self._image_processor.get_number_of_image_patches(image.height, image.width)
        return patches // self._image_processor.merge_size**2


class KimiRemoteProcessorStandIn:
    """The hub's KimiK25Processor as SGLang uses it: `tokenizer`, `image_processor`, `media_processor`."""

    def __init__(self, processor: Any) -> None:
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.media_processor = KimiMediaProcessorStandIn(processor.image_processor)


def as_sglang_sees_it(processor: Any) -> Any:
    """The processor SGLang gets for this checkpoint: a transformers-native Kimi-K2.5 processor behind the remote-code
    stand-in (SGLang reads `media_processor`), anything else as it is."""
    if type(processor).__name__ == "Kimi_K25Processor" and not hasattr(processor, "media_processor"):
        return KimiRemoteProcessorStandIn(processor)
    return processor


def stand_in_remote_processors() -> None:
    """In this (prefill host) process and the ranks it forks: SGLang's receivers get their processor through
    `as_sglang_sees_it` (they call `get_processor` themselves, as the real scheduler does)."""
    from sglang.srt.disaggregation.encoder import receiver

    loader = receiver.get_processor
    if getattr(loader, "stands_in", False):
        return

    def get_processor(*args: Any, **kwargs: Any) -> Any:
        return as_sglang_sees_it(loader(*args, **kwargs))

    get_processor.stands_in = True  # type: ignore[attr-defined]
    receiver.get_processor = get_processor
