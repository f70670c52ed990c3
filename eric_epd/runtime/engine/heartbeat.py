"""The engine's heartbeat: a stamp in shared memory that its loop renews while it lives and its workers do (also
while it waits for a batch), read by the router without a round trip, so a long batch is busy, never dead."""

from __future__ import annotations

import time
from multiprocessing.context import SpawnContext


class Heartbeat:
    """A CLOCK_MONOTONIC stamp (the same clock in every process of the host) the engine renews and the router reads;
    handed to the engine process as a Process argument."""

    def __init__(self, ctx: SpawnContext) -> None:
        self._stamp = ctx.Value("d", time.monotonic(), lock=False)  # one aligned double: written and read whole

    def beat(self) -> None:
        """The engine's loop, or its wait for a batch, ran just now with every worker alive."""
        self._stamp.value = time.monotonic()

    def age(self) -> float:
        """Seconds since the last beat."""
        return max(0.0, time.monotonic() - self._stamp.value)
