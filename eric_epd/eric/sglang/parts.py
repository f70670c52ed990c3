"""The SGLang parts one Eric holds, by req_id: bounded in number (503 beyond SglangConfig.max_parts) and released,
with their pool leases, once idle past SGLang's send/request timeouts."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from eric_epd.eric.config import SglangConfig
from eric_epd.eric.sglang.protocol import Part, SglangError
from eric_epd.transfer.producer import TransferHub

logger = logging.getLogger(__name__)
RANK_PARTS_SHARE, RANK_PARTS_FLOOR = 8, 64
"""A host's ranks may hold at most 1/8 of --sglang-max-parts (but never fewer than 64) in parts that no /encode has
come for yet."""


def rank_quota(max_parts: int) -> int:
    """Parts one host's rank calls may hold before their /encode comes, under --sglang-max-parts `max_parts`."""
    return max(RANK_PARTS_FLOOR, max_parts // RANK_PARTS_SHARE)


class PartTable:
    """req_id -> Part. A part is made by the first call naming its req_id (/encode or a rank's) and dropped when it
    is released: delivered, failed, or idle longer than its timeout (`expire`)."""

    def __init__(self, hub: TransferHub, settings: SglangConfig) -> None:
        self.hub = hub
        self.settings = settings
        self._parts: dict[str, Part] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def __iter__(self) -> Iterator[Part]:
        return iter(list(self._parts.values()))

    def find(self, req_id: str) -> Part | None:
        """The part, if held; not touched."""
        return self._parts.get(req_id)

    def get(self, req_id: str, create: bool = True, rank: str | None = None) -> Part | None:
        """The part of `req_id` (made if `create`), its idle clock restarted; 503 when a new one would pass
        max_parts (after expiring what is due), or when made by a rank's call (`rank`: its caller's address) that
        already made RANK_PARTS_PER_PEER parts no /encode has come for: one host's calls cannot fill the table."""
        part = self._parts.get(req_id)
        if part is None and create:
            if rank is not None:
                self._check_quota(rank)
            if len(self._parts) >= self.settings.max_parts:
                self.expire()
            if len(self._parts) >= self.settings.max_parts:
                logger.warning(
                    "SGLang: refused req_id=%s: %d parts held (--sglang-max-parts)", req_id, len(self._parts)
                )
                raise SglangError(
                    503, f"too many SGLang parts in flight ({len(self._parts)}, --sglang-max-parts); retry later"
                )
            part = self._parts[req_id] = Part(req_id, creator=rank)
        if part is not None:
            part.touched = time.monotonic()
        return part

    def _check_quota(self, caller: str) -> None:
        waiting = sum(1 for p in self._parts.values() if p.request is None and p.creator == caller)
        if waiting >= rank_quota(self.settings.max_parts):
            logger.warning("SGLang: refused a part for %s: %d parts of its ranks wait for an /encode", caller, waiting)
            raise SglangError(
                503, f"{waiting} parts made by this host's ranks wait for their /encode (--sglang-max-parts); retry"
            )

    def release(self, part: Part, force: bool = False) -> None:
        """Drop the part and acknowledge its leases (once per distinct pool entry), unless a transfer or its encode
        still runs. Called again after a forced release, it gives back what the encode took since (idempotent)."""
        if part.active and not force:
            return
        part.released = True
        if self._parts.get(part.req_id) is part:
            del self._parts[part.req_id]
        staged, part.staged = part.staged, None
        if staged is not None:
            self.hub.release(staged)
        self.ack(part)

    def ack(self, part: Part) -> None:
        """Return Eric's leases (once per distinct pool entry, once the encode answered); idempotent."""
        if part.acked or part.answers is None:
            return
        part.acked = True
        seen = set()
        for answer in part.answers or ():
            h = answer.handle
            if (h.hash, h.generation) in seen:
                continue
            seen.add((h.hash, h.generation))
            status, message = self.hub.ack(h.hash, h.lease)
            if status != 200:
                logger.debug("ack of %s for %s: %s", h.hash[:12], part.req_id, message)

    def expire(self, now: float | None = None) -> int:
        """Release parts no rank came for (or whose /encode never came) after SGLang's timeouts; returns how many."""
        now = time.monotonic() if now is None else now
        released = 0
        for part in list(self._parts.values()):
            limit = self.settings.send_timeout_s if part.request is not None else self.settings.req_timeout_s
            if not part.active and not part.delivering and now - part.touched > limit:
                logger.warning("SGLang part %s released unclaimed after %.0f s", part.req_id, now - part.touched)
                self.release(part)
                released += 1
        return released

    def close(self) -> None:
        """Release every part, in use or not (the server is stopping)."""
        for part in list(self._parts.values()):
            self.release(part, force=True)
