"""Which media URLs the Eric router may fetch: scheme, host (SSRF) and file-root rules.

Also home of ``MediaError``, the 4xx error raised for every bad media input.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit

from eric_epd.common.errors import ApiError
from eric_epd.common.jsonbody import MAX_URL

logger = logging.getLogger(__name__)

SUPPORTED_SCHEMES = frozenset({"http", "https", "data", "file"})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
"""The only IPv6 space a media host may be in (unless it embeds an IPv4 address)."""
_AUTHORITY = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::(?P<port>[0-9]{1,5}))?")
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_NUMERIC_LABEL = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)")
_BAD_CHARS = frozenset('\\"<>^`{|}')
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Lookup = Callable[[str, int], Awaitable[list[str]]]
"""(name, port) -> its addresses, or MediaError 400 (media.resolver.MediaResolver.resolve)."""


class MediaError(ApiError):
    """Bad media input; maps to an HTTP 4xx."""


def display_url(url: str, limit: int = 120) -> str:
    """The URL as shown in error messages: credentials dropped, long URLs (data:) shortened."""
    if url[:5].lower() != "data:":  # not url.lower(): a data: URL can be megabytes
        try:
            parts = urlsplit(url)
            if parts.username is not None or parts.password is not None:
                url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        except ValueError:
            pass
    return url if len(url) <= limit else url[:limit] + "..."


def is_public_ip(ip: IPAddress) -> bool:
    """True for globally routable unicast addresses. IPv6 by an allowlist: IPv4 inside it (mapped, 6to4, NAT64's
    well-known prefix) is judged as IPv4; anything else must be global unicast (2000::/3) and not special-purpose."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            ip = embedded
        elif ip not in _GLOBAL_UNICAST:
            return False  # ::ffff:0:a.b.c.d, 64:ff9b:1::/48, fec0::/10, ::a.b.c.d and every other non-2000::/3 form
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
        if scheme != "data" and len(url) > MAX_URL:  # before any parsing; data: URLs are bounded by the body limit
            raise MediaError(400, f"the URL is {len(url)} characters long, over the limit of {MAX_URL}")
        if scheme == "data":
            if "," not in url:
                raise MediaError(400, "malformed data URL: no ',' before the payload")
            return
        if scheme in ("http", "https"):
            check_unambiguous(url)
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

    async def resolve_host(self, host: str, port: int, lookup: Lookup) -> list[str]:
        """Resolve ``host`` with ``lookup`` and return the addresses to connect to; 400 if any is refused by policy."""
        name = host.strip("[]").lower()
        addrs = await lookup(name, port)
        if not addrs:
            raise MediaError(400, f"could not resolve host {name!r}")
        for addr in addrs:
            if not self._ip_allowed(name, ipaddress.ip_address(addr.split("%")[0])):
                logger.warning("refusing media host %s: resolves to non-public address %s", name, addr)
                # the address itself stays in the log: a client learns nothing about internal names
                raise MediaError(400, f"host {name} resolves to a private/loopback/reserved address; refused")
        return addrs

    def _ip_allowed(self, host: str, ip: IPAddress) -> bool:
        if self.allow_private_hosts or host.lower() in self.host_allowlist:
            return True
        return str(ip) in self.host_allowlist or is_public_ip(ip)


def check_unambiguous(url: str) -> None:
    """400 for an http(s) URL that URL parsers could read differently (Python's urlsplit, urllib3, WHATWG, curl):
    characters outside printable ASCII or that some parsers treat as separators (backslash, quotes, braces...),
    credentials (user@host), anything but ``//`` after the scheme, hosts other than plain DNS names, canonical
    dotted IPv4 or bracketed IPv6 without zone, numeric hosts in other forms (``0x7f.1``, ``2130706433``,
    ``017.0.0.1``), ports outside 1-65535 and stray ``%``."""
    shown = url if len(url) <= 120 else url[:120] + "..."  # as sent: hiding the trick would hide the reason
    bad = next((c for c in url if not "!" <= c <= "~" or c in _BAD_CHARS), None)
    if bad is not None:
        raise MediaError(400, f"URL contains {bad!r}, which URL parsers read differently; refused: {shown!r}")
    if _BAD_PERCENT.search(url):
        raise MediaError(400, f"URL has a '%' not followed by two hex digits; refused: {shown!r}")
    scheme, _, rest = url.partition(":")
    if not rest.startswith("//") or rest.startswith("///"):
        raise MediaError(400, f"an {scheme.lower()} URL needs exactly '//' before its host; refused: {shown!r}")
    authority = re.split(r"[/?#]", rest[2:], maxsplit=1)[0]
    if "@" in authority:
        raise MediaError(400, f"URLs with credentials (user@host) are not accepted: {shown!r}")
    match = _AUTHORITY.fullmatch(authority)
    if match is None:
        raise MediaError(400, f"URL host {authority[:80]!r} is not a plain DNS name, IPv4 or [IPv6] address")
    port = match["port"]
    if port is not None and not 0 < int(port) < 65536:
        raise MediaError(400, f"URL port {port} is out of range")
    _check_host(match["host"])


def _check_host(host: str) -> None:
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError as exc:
            raise MediaError(400, f"URL host {host!r} is not a valid IPv6 address") from exc
        return
    labels = host.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise MediaError(400, f"URL host {host!r} is not a plain DNS name (empty, over-long or ill-formed label)")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        try:
            ipaddress.IPv4Address(host)
        except ValueError as exc:
            raise MediaError(
                400, f"URL host {host!r} is a numeric address in a form parsers read differently; write it as a.b.c.d"
            ) from exc


def _split(url: str) -> SplitResult:
    try:
        parts = urlsplit(url)
        _ = parts.port  # validates the port
    except ValueError as exc:
        raise MediaError(400, f"invalid URL {display_url(url)!r}: {exc}") from exc
    return parts
