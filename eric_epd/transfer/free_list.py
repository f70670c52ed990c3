"""The pool's first-fit allocator over byte ranges, in units of ALIGN: what the embedding pool and the vLLM connector's
staging buffer carve their regions from."""

from __future__ import annotations

import bisect

ALIGN = 256  # bytes; keeps every entry cache-line and DMA friendly


def span(nbytes: int) -> int:
    """Bytes an entry of `nbytes` takes in the pool: rounded up to ALIGN (at least ALIGN). All accounting uses it."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class FreeList:
    """First-fit allocator over [0, size) with coalescing of neighbouring free ranges."""

    def __init__(self, size: int) -> None:
        self._starts: list[int] = [0]
        self._sizes: list[int] = [size]

    def allocate(self, nbytes: int) -> int | None:
        """First fit: the start of `span(nbytes)` bytes cut from the lowest free range that holds them; None if none."""
        need = span(nbytes)
        for i, size in enumerate(self._sizes):
            if size >= need:
                start = self._starts[i]
                if size == need:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        """Give back the `span(nbytes)` bytes at `start`, merged with free neighbours on either side."""
        size = span(nbytes)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:  # merge with the next range
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:  # and with the previous one
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    @property
    def free_bytes(self) -> int:
        """Bytes in every free range together."""
        return sum(self._sizes)

    def ranges(self) -> list[tuple[int, int]]:
        """The free (start, size) ranges, in address order."""
        return list(zip(self._starts, self._sizes))
