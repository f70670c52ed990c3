"""What each producer says of its own pool (GET /v1/transfer), learnt once per producer instance by a consumer, so
every handle is checked against the producer's own segment, sessions and pool region before a byte is read."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import httpx
import msgspec

from eric_epd.wire.handles import EmbeddingHandle, ProducerInfo, check_locations

logger = logging.getLogger(__name__)

MAX_PRODUCERS = 256
"""Producer descriptions kept (the least recently used is dropped past it)."""


class ProducerRegions:
    """Thread-safe; one per consumer (EmbeddingFetcher), sharing its HTTP client (which carries the producers' key)."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http
        self._known: OrderedDict[str, ProducerInfo] = OrderedDict()
        self._lock = threading.Lock()

    def _describe(self, producer: str) -> ProducerInfo | str:
        """The producer's own description, or why there is none."""
        try:
            resp = self._http.get(f"{producer}/v1/transfer")
        except httpx.HTTPError as e:
            return f"producer {producer} unreachable for its pool description: {e!r}"
        if resp.status_code != 200:
            return f"producer {producer} answered {resp.status_code} for its pool description"
        try:
            info = msgspec.json.decode(resp.content, type=ProducerInfo)
        except msgspec.DecodeError as e:
            return f"producer {producer} sent an unreadable pool description: {e}"
        with self._lock:
            self._known[producer] = info
            self._known.move_to_end(producer)
            while len(self._known) > MAX_PRODUCERS:
                self._known.popitem(last=False)
        return info

    def check(self, h: EmbeddingHandle) -> str | None:
        """None when the handle's locations are its current producer's own. A reason when the producer cannot say
        (unreachable) or no longer holds that instance (restarted): its locations must not be read then, only the
        global cache may serve the hash. Raises HandleError when a location is foreign to the producer."""
        with self._lock:
            info: ProducerInfo | str | None = self._known.get(h.producer)
        if info is None or info.instance_id != h.instance_id:
            info = self._describe(h.producer)
        if isinstance(info, str):
            return info
        if info.instance_id != h.instance_id:
            return f"{h.producer} is now instance {info.instance_id}, not the handle's {h.instance_id}"
        check_locations(h, info)
        return None
