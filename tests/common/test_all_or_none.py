"""all_or_none: results in order; the first failure cancels the calls still running and is raised once each has
ended."""

from __future__ import annotations

import asyncio

import pytest

from eric_epd.common.all_or_none import all_or_none


def test_the_first_failure_cancels_the_rest() -> None:
    async def run() -> None:
        cancelled = asyncio.Event()

        async def slow() -> int:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return 1

        async def fails() -> int:
            await asyncio.sleep(0)
            raise ValueError("no")

        async def value(v: int) -> int:
            return v

        assert await all_or_none(value(1), value(2)) == [1, 2]
        with pytest.raises(ValueError, match="no"):
            await all_or_none(slow(), fails())
        assert cancelled.is_set()  # the sibling had ended before the failure reached the caller

    asyncio.run(run())
