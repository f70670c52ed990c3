"""Awaiting work that reads a pool region and cannot be stopped (a thread's copy, a one-sided write) to its end even
when the awaiting task is cancelled: the caller frees the region only after, so a cancellation is raised then."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """The result of `work` (or its exception), once it has finished; a cancellation meanwhile is raised after."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()
