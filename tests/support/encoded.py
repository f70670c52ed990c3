"""Eric's answers as the gateway holds them (typed `EncodedItem`s), built from the few fields a test sets."""

from __future__ import annotations

from eric_epd.wire.eric import EncodedItem
from eric_epd.wire.handles import EmbeddingHandle


def encoded(
    key: str,
    grid: list[int] | None = None,
    lease: str = "",
    placement: str = "grid",
    second_per_grid_ts: float | None = None,
    producer: str = "http://eric",
    soundtrack: EncodedItem | None = None,
    timestamps: list[float] | None = None,
) -> EncodedItem:
    """An image (or video, with `second_per_grid_ts`) item with content hash `key * 64` (a one-character `key`) or
    `key` (already 64 hex digits), its handle at `producer` with lease `lease` (default: token-KEY)."""
    digest = key * 64 if len(key) == 1 else key
    grid = grid or [1, 2, 2]
    rows = grid[0] * grid[1] * grid[2] // 4
    handle = EmbeddingHandle(
        digest,
        (rows, 8),
        "float32",
        rows * 32,
        producer,
        "i",
        f"{producer}/v1/embeddings/{digest}",
        lease=lease or f"token-{key}",
    )
    modality = "video" if second_per_grid_ts is not None or timestamps is not None else "image"
    return EncodedItem(
        id="0",
        modality=modality,
        hash=digest,
        shape=[rows, 8],
        dtype="float32",
        num_tokens=rows,
        grid_thw=grid,
        handle=handle,
        second_per_grid_ts=second_per_grid_ts,
        timestamps=timestamps,
        placement=placement,
        soundtrack=soundtrack,
    )  # type: ignore[arg-type]
