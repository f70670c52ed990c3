"""An Eric that joins gateways by itself: it registers with each (admin key, and proof that it holds its own key) at
start, registers again every heartbeat (the gateway drops an Eric whose heartbeats stop) and deregisters at shutdown."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from eric_epd.common.http import bearer
from eric_epd.common.registration import signed_registration

logger = logging.getLogger(__name__)

LEAVE_GRACE_S = 0.5
"""After deregistering, how long an Eric keeps accepting connections before it drains."""


class GatewayMembership:
    """Joins this Eric to its gateways: registers at start and on every heartbeat, deregisters at shutdown."""

    def __init__(
        self, gateways: tuple[str, ...], admin_key: str | None, url: str, heartbeat_s: float, api_key: str | None = None
    ) -> None:
        """`api_key`: this Eric's own key, which the registration proves it holds (the gateway sends its Eric key
        only to an Eric that proved it)."""
        self._gateways = gateways
        self._headers = bearer(admin_key)
        self._url = url
        self._api_key = api_key
        self._heartbeat_s = heartbeat_s
        self._joined: set[str] = set()

    def _body(self) -> bytes:
        """A fresh registration (its proof is good for a minute)."""
        return msgspec.json.encode(signed_registration(self._url, self._api_key))

    async def run(self) -> None:
        """Register with every gateway now and at each heartbeat, until cancelled."""
        async with httpx.AsyncClient(timeout=5.0, headers=self._headers) as client:
            while True:
                await asyncio.gather(*(self._register(client, g) for g in self._gateways))
                await asyncio.sleep(self._heartbeat_s)

    async def _register(self, client: httpx.AsyncClient, gateway: str) -> None:
        try:
            resp = await client.post(
                gateway + "/admin/encoders", content=self._body(), headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as e:
            logger.warning("cannot reach gateway %s to register: %r", gateway, e)
            return
        if resp.status_code != 200:
            logger.warning("gateway %s refused registration: %d %s", gateway, resp.status_code, resp.text[:200])
        elif gateway not in self._joined:
            self._joined.add(gateway)
            logger.info("joined gateway %s as %s", gateway, self._url)

    async def leave(self) -> None:
        """Deregister from every gateway joined (best effort: a gateway that cannot be told drops us by heartbeat),
        then wait LEAVE_GRACE_S: work a gateway sent just before it heard arrives while we still listen."""
        if not self._joined:
            return
        async with httpx.AsyncClient(timeout=5.0, headers=self._headers) as client:
            for gateway in sorted(self._joined):
                try:
                    await client.request(
                        "DELETE",
                        gateway + "/admin/encoders",
                        content=self._body(),
                        headers={"content-type": "application/json"},
                    )
                    logger.info("left gateway %s", gateway)
                except httpx.HTTPError as e:
                    logger.warning("cannot tell gateway %s that we leave: %r", gateway, e)
        self._joined.clear()
        await asyncio.sleep(LEAVE_GRACE_S)
