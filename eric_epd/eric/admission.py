"""Admission to Eric's encode path: a bound on the items accepted and not answered yet, and the switch that drains."""

from __future__ import annotations

from eric_epd.common.errors import ApiError

DRAINING = "draining: this Eric is stopping and takes no new items"


class Admission:
    """Counts the items of requests accepted and not answered yet (fetching, preparing, encoding) and refuses more
    than `max_items`, or any at all once draining: a bound on what fetching and preprocessing hold before the
    engine's own queue sees any of it."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.admitted = 0
        self.draining = False

    def admit(self, n: int) -> None:
        """Count `n` more items as accepted, or refuse them: 503 to retry (draining, or full), 413 if they never
        could fit."""
        if self.draining:
            raise ApiError(503, f"{DRAINING}; send the items to another Eric", retry_after=1.0)
        if n > self.max_items:
            raise ApiError(
                413,
                f"{n} items in one request; this Eric takes at most {self.max_items} at a time (--max-queued-items)",
            )
        if self.admitted + n > self.max_items:
            raise ApiError(503, f"{self._full()}; retry later", retry_after=1.0)
        self.admitted += n

    def done(self, n: int) -> None:
        """`n` admitted items were answered (or failed)."""
        self.admitted -= n

    def room(self) -> str | None:
        """Why a new item would be refused now (draining, or admission full), or None: the Eric's readiness."""
        if self.draining:
            return DRAINING
        return self._full() if self.admitted >= self.max_items else None

    def _full(self) -> str:
        return f"queue full: {self.admitted} items accepted and not answered yet (--max-queued-items {self.max_items})"
