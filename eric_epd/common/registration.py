"""The body an Eric registers with a gateway by (POST/DELETE /admin/encoders), defined once for both sides, with the
proof that the registrant holds the Erics' key: an HMAC of its URL and the time, so the key itself never travels; and
the challenge an Eric found by name answers (GET /v1/member-proof) before the gateway sends it the key or media."""

from __future__ import annotations

import hashlib
import hmac
import re
import time

import msgspec

PROOF_MAX_AGE_S = 60.0
"""A proof is taken this many seconds either side of the gateway's clock (a heartbeat sends a fresh one)."""


class Registration(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What POST and DELETE /admin/encoders take."""

    url: str
    """The Eric's base URL, http(s)://host:port."""
    proof: str | None = None
    """Hex HMAC-SHA256 of f"{url}\\n{ts}" under the Erics' key (registration_proof); None from an unkeyed Eric."""
    ts: int | None = None
    """Unix time in seconds the proof was made at."""


def registration_proof(key: str, url: str, ts: int) -> str:
    """Hex HMAC-SHA256 of the URL and the time under `key`."""
    return hmac.new(key.encode(), f"{url}\n{ts}".encode(), hashlib.sha256).hexdigest()


def signed_registration(url: str, key: str | None, now: float | None = None) -> Registration:
    """The body an Eric whose own key is `key` sends (unsigned when it has none)."""
    if key is None:
        return Registration(url)
    ts = int(time.time() if now is None else now)
    return Registration(url, registration_proof(key, url, ts), ts)


def proves_key(registration: Registration, key: str, now: float | None = None) -> bool:
    """Whether the registrant showed it holds `key`: a proof for this URL, made within PROOF_MAX_AGE_S of now."""
    if registration.proof is None or registration.ts is None:
        return False
    now = time.time() if now is None else now
    if abs(now - registration.ts) > PROOF_MAX_AGE_S:
        return False
    expected = registration_proof(key, registration.url, registration.ts)
    return hmac.compare_digest(registration.proof.encode(), expected.encode())


MEMBER_PROOF_PATH = "/v1/member-proof"
"""Eric's unkeyed route answering a gateway's challenge: GET with ?nonce=HEX, answers MemberProof."""
NONCE_HEX = re.compile(r"[0-9a-f]{32,128}")


class MemberProof(msgspec.Struct, forbid_unknown_fields=True):
    """Eric's answer to a membership challenge."""

    proof: str
    """Hex HMAC-SHA256 under the Erics' key of the nonce and the address the challenge reached (member_proof)."""


def member_proof(key: str, nonce: str, address_url: str) -> str:
    """Hex HMAC-SHA256 under `key` of the nonce and `address_url` (http://ADDR:PORT, common.dns.address_url): the
    address is the one the Eric's own socket accepted the challenge on, so a stranger relaying a gateway's challenge to
    a real Eric gets a proof for that Eric's address, not its own."""
    return hmac.new(key.encode(), f"eric-epd member\n{nonce}\n{address_url}".encode(), hashlib.sha256).hexdigest()


def proves_membership(answer: MemberProof, key: str, nonce: str, address_url: str) -> bool:
    """Whether `answer` is the proof for this nonce at this address under `key`."""
    return hmac.compare_digest(answer.proof.encode(), member_proof(key, nonce, address_url).encode())
