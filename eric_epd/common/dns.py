"""Names that stand for a set of Erics (a Kubernetes headless Service): NAME:PORT targets, and each address a name
resolves to as an Eric's base URL `http://ADDR:PORT` (what the gateway calls and what handles name as producer)."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_ADDRESSES = 256
"""At most this many addresses of one name are taken (the lowest, sorted): a name cannot grow a member list
without bound."""
_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?$")


@dataclass(frozen=True, order=True)
class DnsTarget:
    """A name whose addresses each serve Eric at `port`."""

    name: str
    port: int

    def __str__(self) -> str:
        return f"{self.name}:{self.port}"


def parse_dns_target(value: str) -> DnsTarget:
    """`NAME:PORT` (e.g. erics.default.svc.cluster.local:8100); ValueError naming what is wrong."""
    name, sep, port = value.strip().rpartition(":")
    if not sep or not _NAME.match(name) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not NAME:PORT (a DNS name, such as a headless Service's, and a port)")
    return DnsTarget(name.lower(), int(port))


def address_url(address: str, port: int) -> str:
    """The base URL of the Eric at this address: `http://10.0.0.5:8100`, `http://[fd00::5]:8100` (scope dropped)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return f"http://[{ip}]:{port}" if ip.version == 6 else f"http://{ip}:{port}"


def is_address_url(url: str, ports: set[int] | frozenset[int]) -> bool:
    """Whether `url` is exactly address_url(ADDR, PORT) for some IP address and one of `ports`: the only shape a
    name's member can have (anything else is never looked up)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        return host is not None and port in ports and address_url(host, port) == url
    except ValueError:
        return False


def _urls(target: DnsTarget, infos: list) -> frozenset[str]:
    return frozenset(sorted({address_url(str(info[4][0]), target.port) for info in infos})[:MAX_ADDRESSES])


async def resolve_urls(target: DnsTarget) -> frozenset[str]:
    """The name's current members (asyncio's getaddrinfo, TCP); OSError (socket.gaierror) when the lookup fails."""
    infos = await asyncio.get_running_loop().getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM)
    return _urls(target, infos)


def resolve_urls_blocking(target: DnsTarget) -> frozenset[str]:
    """resolve_urls for a thread without an event loop."""
    return _urls(target, socket.getaddrinfo(target.name, target.port, type=socket.SOCK_STREAM))
