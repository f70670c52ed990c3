"""The challenge an Eric found by name answers before the gateway sends it the Erics' key or any client's media: a
fresh nonce, answered with an HMAC under the key of the nonce and the address the challenge reached."""

from __future__ import annotations

import logging
import secrets

import httpx
import msgspec

from eric_epd.common.registration import MEMBER_PROOF_PATH, MemberProof, proves_membership

logger = logging.getLogger(__name__)


class MembershipProver:
    """Asks an address (http://ADDR:PORT, as a name's members are named) to prove it holds the Erics' key, over a
    client that carries no key."""

    def __init__(self, unkeyed: httpx.AsyncClient, key: str, timeout_s: float = 2.0) -> None:
        self._client = unkeyed
        self._key = key
        self._timeout_s = timeout_s

    async def __call__(self, url: str) -> bool:
        """Whether the Eric at `url` proved it holds the key (False for any failure to answer, or a wrong proof)."""
        nonce = secrets.token_hex(16)
        try:
            resp = await self._client.get(url + MEMBER_PROOF_PATH, params={"nonce": nonce}, timeout=self._timeout_s)
            if resp.status_code != 200:
                logger.warning("encoder %s did not answer its membership challenge (HTTP %d)", url, resp.status_code)
                return False
            answer = msgspec.json.decode(resp.content, type=MemberProof)
        except (httpx.HTTPError, msgspec.DecodeError) as e:
            logger.warning("encoder %s did not answer its membership challenge: %r", url, e)
            return False
        if not proves_membership(answer, self._key, nonce, url):
            logger.warning("encoder %s answered its membership challenge with a wrong proof: not admitted", url)
            return False
        return True
