"""vLLM's encoder cache as the connector's scheduler side sees it: read from the scheduler's own encoder cache
manager, never a copy kept by the connector, since vLLM resets that cache (new weights, a pause that clears the
caches, the reset endpoint) without telling its connector."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def building_scheduler() -> Any | None:
    """The vLLM scheduler whose constructor is running, found up the call stack (vLLM builds its EC connector there
    and hands the connector no reference to it); None outside one."""
    from vllm.v1.core.sched.interface import SchedulerInterface

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, SchedulerInterface):
            return owner
        frame = frame.f_back
    return None


class VllmEncoderCache:
    """What `scheduler`'s encoder cache holds now, and what it held earlier in the current scheduling pass. Without
    a scheduler it holds nothing: every item is then fetched, even one vLLM holds (correct, only wasteful)."""

    def __init__(self, scheduler: Any | None) -> None:
        if scheduler is None:
            logger.warning(
                "EricECConnector built outside a vLLM scheduler: it cannot see vLLM's encoder cache, so "
                "it fetches every item from Eric, even one vLLM already holds"
            )
        self._scheduler = scheduler
        self._this_pass: set[str] = set()

    def holds(self, request: Request, index: int) -> bool:
        """Whether vLLM's encoder cache holds the request's item `index` now (remembered until the pass ends)."""
        manager = getattr(self._scheduler, "encoder_cache_manager", None)
        if manager is None or manager.get_cached_num_encoder_embeds(request, index) is None:
            return False
        self._this_pass.add(request.mm_features[index].identifier)
        return True

    def held_this_pass(self, key: str) -> bool:
        """Whether vLLM held `key` earlier in this scheduling pass. One it evicted since (to make room for another
        item of the same request) keeps its rows on the workers until the pass ends, and for good when the pass
        allocates it again: vLLM frees on the workers only the items still evicted at the end of the pass."""
        return key in self._this_pass

    def evict(self, key: str) -> set[str]:
        """Drop `key` from vLLM's encoder cache manager at once (its rows on the workers are zeros: a rank had no
        landed copy), its room given back and the workers told to free it; the requests that may have used it, which
        must fail: those holding it, and every live one that has computed into its span (vLLM lets go of an item
        a request has computed before the connector hears of the step). The manager's own eviction (can_allocate)
        does the same to an unused entry; vLLM has no call for it."""
        users = self._computed_into(key)
        manager = getattr(self._scheduler, "encoder_cache_manager", None)
        cached = getattr(manager, "cached", None)
        if isinstance(cached, dict) and key in cached:
            users |= cached.pop(key)
            embeds = manager.num_embeds_by_hash.pop(key)
            if manager.freeable.pop(key, None) is None:  # in use: its room was counted out of both
                manager.num_freeable_slots += embeds
            manager.num_free_slots += embeds
            manager.freed.append(key)
        logger.error("embedding %s dropped from vLLM's encoder cache: a rank had no copy; failing %s", key, users)
        return users

    def _computed_into(self, key: str) -> set[str]:
        """The live requests with an item `key` whose computed tokens reach into its placeholder span."""
        requests = getattr(self._scheduler, "requests", None)
        if not isinstance(requests, dict):
            return set()
        return {
            rid
            for rid, request in requests.items()
            if any(
                f.identifier == key and request.num_computed_tokens > f.mm_position.offset for f in request.mm_features
            )
        }

    def pass_ended(self) -> None:
        """The scheduling pass is over (its evictions reach the workers with this step)."""
        self._this_pass.clear()
