"""Who may register an Eric with this gateway (/admin/encoders): the admin key, a caller and an Eric URL inside
--register-from, and (when the gateway holds the Erics' key) proof that the registrant holds that key too."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
from urllib.parse import urlsplit

import httpx
import msgspec
from starlette.requests import Request

from eric_epd.common.errors import ApiError, read_body
from eric_epd.common.jsonbody import MAX_URL
from eric_epd.common.registration import Registration, proves_key

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")
"""Registration is taken from the connecting address only: a request carrying these is refused."""


def parse_network(value: str) -> Network:
    """A --register-from value: an address or a CIDR (argparse shows the message of a bad one)."""
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an IP address or CIDR such as 10.0.0.0/24") from None


def _address(text: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip


class RegistrationGate:
    """Checks one /admin/encoders call; `admit` answers the URL to add or remove, or raises the ApiError."""

    def __init__(self, admin_key: str | None, networks: tuple[Network, ...], eric_key: str | None) -> None:
        self._admin_key = admin_key
        self._networks = networks
        self._eric_key = eric_key

    def _inside(self, ip: Address | None) -> bool:
        return ip is not None and any(ip.version == n.version and ip in n for n in self._networks)

    async def admit(self, request: Request, joining: bool) -> str:
        """The checks in order: admin key (401), --register-from set, caller's own socket address inside it (403),
        the body (400), the URL's host inside it (403), and for a join, the proof when the gateway has an Eric key
        (403: it would otherwise send its key to a registrant that did not hold it). Nothing here contacts the URL."""
        given = request.headers.get("authorization", "")
        key = self._admin_key
        if key is None or not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "Unauthorized")
        if not self._networks:
            raise ApiError(
                403,
                "registration is off: start the gateway with --register-from CIDR (the networks "
                "Erics may register from)",
            )
        if any(h in request.headers for h in FORWARDING_HEADERS):
            raise ApiError(403, "registration is taken directly from an Eric, not through a proxy")
        peer = request.client.host if request.client else ""
        if not self._inside(_address(peer)):
            raise ApiError(403, f"caller {peer or 'unknown'} is outside --register-from")
        registration = await _read(request)
        url = registration.url
        await self._check_host(url)
        if joining and self._eric_key is not None and not proves_key(registration, self._eric_key):
            logger.warning("refused registration of %s from %s: no valid proof of the Eric key", url, peer)
            raise ApiError(
                403,
                "registration needs a proof of the Erics' key (proof = hex HMAC-SHA256 of "
                '"URL\\nTS" under it, ts = Unix seconds within 60 s)',
                param="proof",
            )
        return url.rstrip("/")

    async def _check_host(self, url: str) -> None:
        """The URL's host must be an address inside --register-from. A name is refused: every later call would
        resolve it again, after this check (DNS rebinding), so what is checked must be what is called."""
        host = urlsplit(url).hostname or ""
        literal = _address(host)
        if literal is None:
            raise ApiError(
                400,
                f"encoder host {host[:80]!r} is a name: register the address it serves at "
                "(http://ADDR:PORT; eric-epd serve --advertise-host ADDR)",
                param="url",
            )
        if not self._inside(literal):
            raise ApiError(403, f"encoder host {host!r} is outside --register-from", param="url")


async def _read(request: Request) -> Registration:
    raw = await read_body(request, 4096)
    try:
        registration = msgspec.json.decode(raw, type=Registration)
    except msgspec.DecodeError as e:
        raise ApiError(
            400, f'body must be {{"url": "http(s)://host:port", "proof": ..., "ts": ...}}: {e}', param="url"
        ) from e
    url = registration.url
    try:
        valid = url.startswith(("http://", "https://")) and len(url) <= MAX_URL and bool(urlsplit(url).hostname)
        urlsplit(url).port  # noqa: B018  # a port that is not a number raises here
        httpx.URL(url)  # what every later call to it parses: control characters and the like are refused here
    except (ValueError, httpx.InvalidURL):
        valid = False
    if not valid:
        raise ApiError(400, 'body must be {"url": "http(s)://host:port"}', param="url")
    return registration
