"""One Eric as the gateway's encoder pool sees it (health, load, model card) and how an item is weighed between
Erics: its rendezvous weight and an Eric's expected wait."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from epd_gateway.loadcheck import Completions, believed_load
from eric_epd.wire.eric import GRID, Placement
from eric_epd.wire.load import LoadReport

CARD_RETRY_S = 5.0
"""Seconds before a model card that could not be read is read again."""
CARD_TIMEOUT_S = 2.0
"""How long a read of an Eric's /v1/models card may take (a request may be waiting for it)."""
MAX_REST_S = 5.0
"""The longest an Eric that answered 503 with Retry-After (busy, or draining) is passed over for new items."""
WAIT_SLACK_S = 0.5
"""A new item leaves its content's own Eric (rendezvous) only for one whose expected wait is this much shorter."""


@dataclass
class EncoderState:
    """One Eric as the pool sees it: health, failures, work in flight, modalities and its last load report."""

    url: str
    healthy: bool = True
    failures: int = 0
    inflight: int = 0
    modalities: frozenset[str] | None = None
    """What it encodes (from its /v1/models card), learnt on first need; None until read (taken to encode all)."""
    card_after: float = 0.0
    """No new try at reading its card before this (monotonic): a failed read is tried again, not every request."""
    placement: Placement = GRID
    """How the engine places its items (its card's `placement`; "grid" until known or if unreadable)."""
    takes_audio: bool | None = None  # whether its model takes audio (its card's); None: unknown
    load: LoadReport | None = None
    """Its last /v1/load answer (read with each health probe); None until it answered one."""
    inflight_items: int = 0
    completed: Completions = field(default_factory=Completions)
    """Items it answered this gateway recently: what its reported throughput is checked against."""
    heartbeat: float | None = None
    """When it last registered itself (monotonic); None for an Eric listed by hand (never dropped for silence)."""
    by_name: bool = False
    """Admitted because a name lists it (dns_members.py)."""
    resting_until: float = 0.0
    """Passed over for new items until then (monotonic), while others are awake: it answered 503 with Retry-After
    (its queue is full, or it drains). Not a failure: it is neither counted nor ejected for it."""
    proven: bool = True
    """Whether it may be sent the key and media: an Eric found by name is not until it answers a challenge
    (proof.py), and not again once ejected (its address may be another pod's by then)."""

    def believed(self) -> LoadReport | None:
        """Its load report bounded and checked against what this gateway observes (loadcheck.py); None if none."""
        if self.load is None:
            return None
        return believed_load(self.load, self.inflight_items, self.completed.per_s())


def rendezvous_weight(key: bytes, url: str) -> bytes:
    """An encoder's weight for a routing key: the heaviest healthy encoder is the key's own Eric."""
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


def expected_wait(member: EncoderState) -> float:
    """Seconds until an item sent now would start on this Eric: what is queued there (and in flight from here) at
    its recent rate (at least one item a second, so a freshly started Eric is not taken for a stuck one), both as
    the gateway believes them (loadcheck.py: bounded, never less queued than in flight from here, never faster than
    a multiple of what it saw the Eric answer)."""
    load = member.believed()
    assert load is not None
    return (load.queue_depth + member.inflight) / max(load.items_per_s, 1.0)


def rest_s(retry_after: str) -> float:
    """How long to pass over an Eric that answered 503 with this Retry-After (seconds; at most MAX_REST_S)."""
    try:
        return min(max(float(retry_after), 0.0), MAX_REST_S)
    except ValueError:  # an HTTP date, or garbage: a second, as Eric's own
        return 1.0
