"""A part's rows in the pool: staged in the prefill's dtype, and read out as SGLang's header, payload or ranges."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from eric_epd.eric.answers import Staging
from eric_epd.eric.processor import PreparedItem
from eric_epd.eric.sglang.protocol import ELEMENT_BYTES, MODALITIES, Part, SglangError
from eric_epd.transfer.producer import TransferHub, Want
from eric_epd.wire.sglang import EmbeddingPart, embedding_data_pickle


class PartRows:
    """A part's rows in the pool: staged in the prefill's dtype and read out as header, payload or ranges."""

    def __init__(
        self,
        hub: TransferHub,
        width: Callable[[str], int],
        eric_dtype: str,
        wire_dtype: str,
        video_seconds: float | None = None,
    ) -> None:
        self.hub = hub
        self.width = width
        """Values per row of an item of a modality (Eric's names): Qwen3-Omni's image and audio rows differ."""
        self.eric_dtype = eric_dtype
        self.dtype = wire_dtype
        """What the part header announces and the rows are in (the prefill's model dtype)."""
        self.video_seconds = video_seconds
        """The second_per_grid_ts a video without its own gets (protocol.sglang_video_seconds), or None."""

    def dim(self, part: Part) -> int:
        """Values per row of the part (that of its modality)."""
        assert part.request is not None
        return self.width(MODALITIES[part.request.modality.upper()])

    def staging(self, part: Part) -> Staging | None:
        """The pool space of the part's rows in the wire dtype, for the service to reserve with its items (all or
        none: no part holds its embeddings while it waits for this space); None if Eric's dtype is the wire's."""
        if self.dtype == self.eric_dtype:
            return None
        dim, key = self.dim(part), f"sglang-stage:{part.req_id}"

        def want(prepared: list[PreparedItem]) -> list[Want]:
            tokens = sum(p.item.num_tokens for p in prepared)
            return [Want(key, tokens * dim * ELEMENT_BYTES[self.dtype], (tokens, dim), self.dtype)]

        return Staging(want)

    def stage(self, part: Part) -> bool:
        """Rows in the wire dtype: Eric's pool entries as they are, or one converted copy in the pool (in the space
        `staging` reserved, registered with the push engines like every pool byte). True if a copy was made (Eric's
        own entries are then free)."""
        audio_grid(part)  # an audio part's header must be writable before anything is sent
        part.wire_bytes = part.tokens * self.dim(part) * ELEMENT_BYTES[self.dtype]
        if part.staged is None:
            return False
        import torch

        if part.staged.nbytes != part.wire_bytes:
            raise SglangError(500, f"[{part.req_id}] staged {part.staged.nbytes} bytes for {part.wire_bytes}")
        src_dtype, offset = getattr(torch, self.eric_dtype), 0
        dst = torch.from_numpy(self.hub.pool.view(part.staged)).view(getattr(torch, self.dtype))
        for row in self.entries(part, staged=False):
            rows = torch.from_numpy(self.hub.pool.view(row)).view(src_dtype)
            dst[offset : offset + rows.numel()] = rows  # the same rounding as Tensor.to(dtype)
            offset += rows.numel()
        return True

    def entries(self, part: Part, staged: bool = True) -> list[Any]:
        """The pool entries holding the part's rows: its converted copy when `staged`, else each item's own entry."""
        if staged and part.staged is not None:
            entry = self.hub.pool.get(part.staged.hash)
            if entry is not part.staged:
                raise SglangError(500, f"staged part {part.req_id} left the pool")
            return [entry]
        entries = []
        for answer in part.answers or ():
            entry = self.hub.pool.get(answer.handle.hash)
            if entry is None or entry.generation != answer.handle.generation:
                raise SglangError(500, f"embedding {answer.handle.hash} left the pool before it was sent")
            entries.append(entry)
        return entries

    @contextlib.contextmanager
    def reading(self, part: Part) -> Iterator[None]:
        """While a send may read the part's rows, it holds their regions' fence: whatever frees the entries meanwhile
        (the TTL, an ack, the sweep), no region is reused under the send (an error part sends no rows)."""
        entries = self.entries(part) if part.error is None else []
        holds = [self.hub.pool.hold(entry, "sglang-send") for entry in entries]
        try:
            yield
        finally:
            for hold in holds:
                hold.end()

    def header(self, part: Part) -> bytes:
        """The pickled part header SGLang reads: the grids, dtype and shape, or the error of a failed part."""
        req = part.request
        assert req is not None
        modality = req.modality.upper()
        if part.error is not None:
            return embedding_data_pickle(
                EmbeddingPart(
                    req_id=part.req_id,
                    num_parts=req.num_parts,
                    part_idx=req.part_idx,
                    modality=modality,
                    grid=None,
                    dtype=None,
                    shape=None,
                    error_msg=part.error[0],
                    error_code=part.error[1],
                )
            )
        answers = part.answers or []
        extra: dict[str, list[float] | list[list[float]]] = {}
        tensors: dict[str, list[float]] = {}
        seconds = [a.prepared.item.second_per_grid_ts for a in answers]
        if modality == "VIDEO" and all(s is not None for s in seconds):  # Qwen2.5-VL's M-RoPE spaces frames by time
            extra["second_per_grid_ts"] = seconds
        elif modality == "VIDEO" and self.video_seconds is not None:  # Qwen3-Omni's: SGLang's encoder's, a tensor
            tensors["second_per_grid_ts"] = [self.video_seconds] * len(answers)
        stamps = [a.prepared.item.timestamps for a in answers]
        if modality == "VIDEO" and all(s is not None for s in stamps):  # Qwen3-VL writes them into the prompt
            extra["video_timestamps"] = [list(s) for s in stamps if s is not None]
        grid: list[list[int]] | list[int] = (
            audio_grid(part) if modality == "AUDIO" else [list(a.prepared.item.grid_thw) for a in answers]
        )
        return embedding_data_pickle(
            EmbeddingPart(
                req_id=part.req_id,
                num_parts=req.num_parts,
                part_idx=req.part_idx,
                modality=modality,
                grid=grid,
                dtype=self.dtype,
                shape=[part.tokens, self.dim(part)],
                extra=extra,
                float_tensors=tensors,
            )
        )

    def payload(self, part: Part) -> memoryview | bytes:
        """The part's rows, contiguous: a view of the pool for one entry, a copy for several."""
        views = [self.hub.pool.view(e) for e in self.entries(part)]
        return memoryview(views[0]) if len(views) == 1 else np.concatenate(views).tobytes()

    def ranges(self, part: Part) -> tuple[list[int], list[int]]:
        """The rows' pool addresses and byte lengths, entry by entry (the sources of a push)."""
        entries = self.entries(part)
        return [self.hub.pool.base_addr + e.offset for e in entries], [e.nbytes for e in entries]


def audio_grid(part: Part) -> list[int]:
    """An audio part's grid as SGLang's encoder sends it: each item's feature frames (audio_feature_lens_raw), from
    which SGLang's Qwen2-Audio processor (and its Qwen-VL one's qwen2_5_omni branch) compute the item's token count;
    [] for other parts."""
    req = part.request
    if req is None or req.modality.upper() != "AUDIO":
        return []
    frames = [a.prepared.item.feature_frames for a in part.answers or ()]
    if any(f is None for f in frames):
        raise SglangError(
            400,
            f"[{part.req_id}] this model's audio items carry no feature-frame count "
            "(feature_attention_mask), which SGLang's prefill expands the audio placeholder from",
        )
    return [int(f) for f in frames if f is not None]
