"""Awaiting several calls together where one failure makes the others pointless: the first failure (or a
cancellation of the caller) cancels the ones still running, so none keeps working for an answer nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def all_or_none(*work: Awaitable[T]) -> list[T]:
    """Every result, in order; on the first exception the rest are cancelled, and once every one has ended (none
    runs on, holding what its caller counts as released) that exception is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
