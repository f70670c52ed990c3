"""Which media URLs the Eric router may fetch: scheme, host (SSRF) and file-root rules.

Also home of ``MediaError``, the 4xx error raised for every bad media input.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

logger = logging.getLogger(__name__)

SUPPORTED_SCHEMES = frozenset({"http", "https", "data", "file"})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(Exception):
    """Bad media input; maps to an HTTP 4xx."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"MediaError({self.status}, {self.message!r})"


def display_url(url: str, limit: int = 120) -> str:
    """The URL as shown in error messages: credentials dropped, long URLs (data:) shortened."""
    if not url.lower().startswith("data:"):
        try:
            parts = urlsplit(url)
            if parts.username is not None or parts.password is not None:
                url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        except ValueError:
            pass
    return url if len(url) <= limit else url[:limit] + "..."


def is_public_ip(ip: IPAddress) -> bool:
    """True for globally routable unicast addresses; unwraps IPv4 embedded in IPv6 first."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not ip.is_multicast


def url_scheme(url: str) -> str:
    """Lower-cased scheme of ``url`` without parsing the (possibly huge) rest of it; "" if none."""
    end = url.find(":", 0, 32)
    scheme = url[:end] if end > 0 else ""
    ok = scheme[:1].isalpha() and all(c.isascii() and (c.isalnum() or c in "+-.") for c in scheme)
    return scheme.lower() if ok else ""


@dataclass(frozen=True)
class UrlPolicy:
    """Rules for media URLs. ``file_roots`` are stored resolved (symlinks followed) at construction."""

    allowed_schemes: frozenset[str] = frozenset({"http", "https", "data", "file"})
    file_roots: tuple[Path, ...] = ()
    allow_private_hosts: bool = False
    host_allowlist: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        roots = tuple(Path(os.path.realpath(os.path.expanduser(str(r)))) for r in self.file_roots)
        allow = frozenset(h.strip().strip("[]").lower() for h in self.host_allowlist if h.strip())
        object.__setattr__(self, "file_roots", roots)
        object.__setattr__(self, "allowed_schemes", frozenset(s.lower() for s in self.allowed_schemes))
        object.__setattr__(self, "host_allowlist", allow)

    def check(self, url: str) -> None:
        """Raise ``MediaError`` naming the problem if ``url`` may not be fetched.

        No network I/O: hostnames are vetted after DNS resolution by ``resolve_host``. For file://
        URLs the path is resolved on the local filesystem (symlinks followed) and must lie under a root.
        """
        scheme = url_scheme(url)
        if not scheme:
            raise MediaError(400, f"URL has no scheme: {display_url(url)!r}")
        if scheme not in self.allowed_schemes or scheme not in SUPPORTED_SCHEMES:
            allowed = ", ".join(sorted(self.allowed_schemes & SUPPORTED_SCHEMES))
            raise MediaError(400, f"unsupported URL scheme {scheme!r} (allowed: {allowed})")
        if scheme == "data":
            if "," not in url:
                raise MediaError(400, "malformed data URL: no ',' before the payload")
            return
        parts = _split(url)
        if scheme == "file":
            self.resolve_file(url, parts)
            return
        host = parts.hostname
        if not host:
            raise MediaError(400, f"URL has no host: {display_url(url)!r}")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return  # a name: checked after resolution
        if not self._ip_allowed(host, ip):
            raise MediaError(400, f"URL host {host} is a private/loopback/reserved address; refused")

    def resolve_file(self, url: str, parts: SplitResult | None = None) -> Path:
        """Real path (symlinks resolved) of a file:// URL, refused with 403 unless under a file root."""
        parts = parts or _split(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(400, f"file URL must not name a remote host: {display_url(url)!r}")
        if parts.query or parts.fragment:
            raise MediaError(400, "file URL must not contain '?' or '#' (percent-encode them)")
        path = unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise MediaError(400, f"file URL needs an absolute path: {display_url(url)!r}")
        if not self.file_roots:
            raise MediaError(403, "file:// URLs are disabled (no file roots configured)")
        real = Path(os.path.realpath(path))
        if not any(real == root or real.is_relative_to(root) for root in self.file_roots):
            raise MediaError(403, f"file path {path} is outside the allowed file roots")
        return real

    async def resolve_host(self, host: str, port: int) -> list[str]:
        """Resolve ``host`` and return the addresses to connect to; 400 if any is refused by policy."""
        name = host.strip("[]").lower()
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise MediaError(400, f"could not resolve host {name!r}") from exc
        addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addrs:
            raise MediaError(400, f"could not resolve host {name!r}")
        for addr in addrs:
            if not self._ip_allowed(name, ipaddress.ip_address(addr.split("%")[0])):
                logger.warning("refusing media host %s: resolves to non-public address %s", name, addr)
                raise MediaError(
                    400, f"host {name} resolves to private/loopback/reserved address {addr}; refused"
                )
        return addrs

    def _ip_allowed(self, host: str, ip: IPAddress) -> bool:
        if self.allow_private_hosts or host.lower() in self.host_allowlist:
            return True
        return str(ip) in self.host_allowlist or is_public_ip(ip)


def _split(url: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        _ = parts.port  # validates the port
    except ValueError as exc:
        raise MediaError(400, f"invalid URL {display_url(url)!r}: {exc}") from exc
    return parts
