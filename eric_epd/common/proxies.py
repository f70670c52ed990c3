"""Which proxies a server believes X-Forwarded-For/-Proto from: only those its operator names (--trusted-proxies);
none by default, so no caller (a local process included) can claim another peer address."""

from __future__ import annotations

import ipaddress
from typing import Any

TRUSTED_PROXIES_HELP = (
    "comma-separated IPs or CIDRs of reverse proxies whose X-Forwarded-For/-Proto headers are "
    "believed (default: none; the headers are ignored and the peer is the connecting address)"
)


def parse_trusted_proxies(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The proxies as normalised networks ("10.0.0.0/8", "127.0.0.1/32"); ValueError naming a bad entry. "*" and
    names are refused: trust is given to addresses only."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    networks = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        try:
            networks.append(str(ipaddress.ip_network(entry, strict=False)))
        except ValueError:
            raise ValueError(f"trusted proxy {entry!r} is not an IP address or CIDR such as 10.0.0.0/24") from None
    return tuple(dict.fromkeys(networks))


def uvicorn_proxy_settings(trusted: tuple[str, ...]) -> dict[str, Any]:
    """uvicorn.Config/uvicorn.run keywords: forwarded headers honoured from `trusted` alone; with none, uvicorn's
    proxy-header middleware is off (its own default would trust loopback, or $FORWARDED_ALLOW_IPS)."""
    trusted = parse_trusted_proxies(trusted)
    return {"proxy_headers": bool(trusted), "forwarded_allow_ips": list(trusted)}
