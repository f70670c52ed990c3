"""First-come-first-served scheduler: forms batches of one kind (a modality, an image size), bounded by items and
cost."""

from __future__ import annotations

import itertools
from collections import deque

from eric_epd.runtime.config import BatchLimits
from eric_epd.runtime.work import Batch, QueuedItem


class Scheduler:
    """FCFS queue. The oldest item picks the kind; later items of that kind join while limits allow.

    Items of other kinds are skipped, not reordered, so the oldest item always runs in the next batch
    and nothing starves.
    """

    def __init__(self, limits: BatchLimits) -> None:
        self._limits = limits
        self._queue: deque[QueuedItem] = deque()
        self._batch_ids = itertools.count()

    @property
    def num_queued(self) -> int:
        """Items waiting to be batched."""
        return len(self._queue)

    def add(self, entries: list[QueuedItem]) -> None:
        """Queue `entries` behind the items already waiting, in order."""
        self._queue.extend(entries)

    def drop_request(self, request_id: str) -> None:
        """Forget every queued item of a request (it failed or was cancelled)."""
        self._queue = deque(e for e in self._queue if e.request_id != request_id)

    def drop_items(self, request_id: str, indices: set[int] | None = None) -> set[int]:
        """Forget a request's queued items at `indices` (all when None); return the indices actually dropped."""
        dropped: set[int] = set()
        kept: deque[QueuedItem] = deque()
        for entry in self._queue:
            if entry.request_id == request_id and (indices is None or entry.index in indices):
                dropped.add(entry.index)
            else:
                kept.append(entry)
        self._queue = kept
        return dropped

    def next_batch(self) -> Batch | None:
        """The next batch (None when nothing waits): the oldest item and later ones of its kind, within the caps."""
        if not self._queue:
            return None
        head = self._queue[0]
        batch = Batch(next(self._batch_ids), head.item.kind)
        cost = 0
        kept: deque[QueuedItem] = deque()
        for entry in self._queue:
            fits = (
                entry.item.kind == batch.kind
                and len(batch.entries) < self._limits.max_items
                and (not batch.entries or cost + entry.item.cost <= self._limits.max_patches)
            )
            if fits:
                batch.entries.append(entry)
                cost += entry.item.cost
            else:
                kept.append(entry)
        self._queue = kept
        return batch
