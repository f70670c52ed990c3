"""Async media fetching: http(s), data and file URLs under a ``UrlPolicy`` and ``MediaLimits``, every resolved
address and every redirect re-checked. Used by Eric and by the gateway (which inlines media for the engines)."""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import logging
import os
import socket
import ssl
import stat
from collections.abc import AsyncIterator
from urllib.parse import unquote_to_bytes, urljoin

import aiohttp
import certifi
import pybase64
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.http_exceptions import HttpProcessingError

from eric_epd.media.encoding import ACCEPT_ENCODING, check_layers, content_layers, inflate
from eric_epd.media.limits import MediaLimits
from eric_epd.media.resolver import MediaResolver
from eric_epd.media.url_policy import MediaError, UrlPolicy, display_url, url_scheme

logger = logging.getLogger(__name__)

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_CONNECTIONS = 256
"""Connections the fetcher holds open at once, to every origin together."""
MAX_PER_HOST = 8
"""Fetches from one host at once, across requests: ten slow URLs on one origin hold its slots, not everyone's."""
MAX_PER_REQUEST = 8
"""Fetches of one request (one ByteBudget) at once."""
KEEPALIVE_EXPIRY_S = 5.0
"""An idle pooled connection is closed after this long."""


class _PolicyResolver(AbstractResolver):
    """aiohttp's resolver for media hosts: c-ares (MediaResolver), every address vetted by the policy before the
    connector may connect to it (no DNS rebinding). IP literals never reach a resolver: `MediaFetcher` vets those."""

    def __init__(self, policy: UrlPolicy, resolver: MediaResolver) -> None:
        self._policy = policy
        self._resolver = resolver

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        """The policy's addresses for `host`, as aiohttp's connector takes them."""
        addrs = await self._policy.resolve_host(host, port, self._resolver.resolve)
        return [_resolved(host, addr, port) for addr in addrs]

    async def close(self) -> None:
        """The c-ares channel is the fetcher's to close."""


def _resolved(host: str, addr: str, port: int) -> ResolveResult:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    return {"hostname": host, "host": addr, "port": port, "family": family, "proto": 0, "flags": socket.AI_NUMERICHOST}


def _literal(host: str) -> bool:
    """Whether aiohttp takes `host` for an IP address and connects without asking its resolver (its own test: a colon,
    or only digits and dots; every address that parses passes it). Such a host is vetted here instead (one that does
    not parse is a 400 there)."""
    return ":" in host or host.replace(".", "").isdigit()


class HostSlots:
    """At most `per_host` fetches from one host at once; a host's entry lives only while someone holds or waits."""

    def __init__(self, per_host: int) -> None:
        self._per_host = per_host
        self._hosts: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, host: str) -> AsyncIterator[None]:
        """A slot for `host`, waited for while `per_host` others hold one."""
        sem, users = self._hosts.setdefault(host, (asyncio.Semaphore(self._per_host), [0]))
        users[0] += 1
        try:
            async with sem:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._hosts[host]


class SharedBytes:
    """Bytes held for every request in flight together (the gateway's inlined media): taking past the limit is a
    503 with Retry-After; what a request took is given back when it ends."""

    def __init__(self, limit: int, message: str) -> None:
        self.limit = limit
        self.message = message
        self.held = 0

    def take(self, n: int) -> None:
        """Hold `n` more bytes; 503 (nothing held) if that would pass the limit."""
        if self.held + n > self.limit:
            raise MediaError(503, self.message, retry_after=1.0)
        self.held += n

    def give(self, n: int) -> None:
        """Give back `n` bytes taken before."""
        self.held -= n


class ByteBudget:
    """Bytes that several fetches (one request's) may bring in together: the one that passes it gets a 413 with
    `message`, and so does every later chunk of the others, which stop there. Also caps how many of them run at
    once, and holds its bytes in `shared` (every request's) until `close`."""

    def __init__(
        self, limit: int, message: str, concurrency: int = MAX_PER_REQUEST, shared: SharedBytes | None = None
    ) -> None:
        self.limit = limit
        self.message = message
        self.used = 0
        self.slots = asyncio.Semaphore(concurrency)
        """The request's fetches in flight at once."""
        self._shared = shared
        self._held = 0
        """What this budget holds in `shared`."""

    def take(self, n: int) -> None:
        """Count `n` more bytes; 413 once the total is over the limit, 503 if every request's together would be."""
        self.used += n
        if self.used > self.limit:
            raise MediaError(413, self.message)
        if self._shared is not None:
            self._shared.take(n)
            self._held += n

    def close(self) -> None:
        """Give back to `shared` what this budget held (once)."""
        if self._shared is not None:
            self._shared.give(self._held)
            self._shared, self._held = None, 0


class MediaFetcher:
    """Fetches media bytes for http(s), data and file URLs under a ``UrlPolicy`` and ``MediaLimits``."""

    def __init__(self, policy: UrlPolicy, limits: MediaLimits):
        self.policy = policy
        self.limits = limits
        self.resolver = MediaResolver()
        self._session: aiohttp.ClientSession | None = None
        """Made in the running loop on first use (aiohttp's sessions belong to one loop)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hosts = HostSlots(MAX_PER_HOST)

    def _session_for(self, loop: asyncio.AbstractEventLoop) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                resolver=_PolicyResolver(self.policy, self.resolver),
                use_dns_cache=False,  # every new connection is resolved and vetted again
                limit=MAX_CONNECTIONS,
                keepalive_timeout=KEEPALIVE_EXPIRY_S,
                ssl=_tls_context(),
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),  # one client's origin cookies never go out with another's
                auto_decompress=False,  # bodies come as sent: inflated off the loop, bounded (media/encoding.py)
                trust_env=False,
                timeout=aiohttp.ClientTimeout(total=self.limits.timeout_s),
                headers={"User-Agent": "eric-epd-media/0.1", "Accept-Encoding": ACCEPT_ENCODING},
            )
            self._loop = loop
        return self._session

    async def fetch(self, url: str, budget: ByteBudget | None = None) -> bytes:
        """The bytes behind ``url``, counted against ``budget`` as they come; raises ``MediaError`` (4xx) naming the
        problem."""
        shown = display_url(url)
        try:
            async with budget.slots if budget is not None else contextlib.nullcontext():
                data = await asyncio.wait_for(self._fetch(url, budget), self.limits.timeout_s)
        except TimeoutError as exc:
            raise MediaError(408, f"timed out fetching {shown} (limit {self.limits.timeout_s:g} s)") from exc
        if budget is not None and url_scheme(url) not in ("http", "https"):
            budget.take(len(data))  # read whole (at most the per-item limit); http(s) is counted chunk by chunk
        return data

    async def aclose(self) -> None:
        """Close the pooled HTTP client and the resolver."""
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        await self.resolver.aclose()

    async def resolve_host(self, host: str, port: int) -> list[str]:
        """`host`'s addresses, every one allowed by the policy (what a fetch from it would connect to); 400 if not."""
        return await self.policy.resolve_host(host, port, self.resolver.resolve)

    async def _fetch(self, url: str, budget: ByteBudget | None) -> bytes:
        self.policy.check(url)
        scheme = url_scheme(url)
        if scheme == "data":
            return _decode_data_url(url, self.limits.max_bytes)
        if scheme == "file":
            return await asyncio.to_thread(self._read_file, url)
        return await self._fetch_http(url, budget)

    async def _fetch_http(self, url: str, budget: ByteBudget | None) -> bytes:
        for _hop in range(self.limits.max_redirects + 1):
            shown = display_url(url)
            try:
                result = await self._get(url, budget)
            except (MediaError, TimeoutError):
                raise
            except (aiohttp.ClientError, HttpProcessingError, ValueError) as exc:  # a body the parser refused too
                raise MediaError(400, f"could not fetch {shown}: {_describe(exc)}") from exc
            if isinstance(result, bytes):
                return result
            url = result
            try:
                if url_scheme(url) not in ("http", "https"):
                    raise MediaError(400, f"unsupported URL scheme {url_scheme(url)!r} for a redirect")
                self.policy.check(url)
            except MediaError as exc:
                raise MediaError(exc.status, f"redirect from {shown} refused: {exc.message}") from exc
        raise MediaError(400, f"too many redirects (more than {self.limits.max_redirects})")

    async def _get(self, url: str, budget: ByteBudget | None) -> bytes | str:
        """One GET: the body, or the absolute redirect target."""
        shown, max_bytes = display_url(url), self.limits.max_bytes
        target = yarl.URL(url, encoded=True)  # as the client wrote it (check_unambiguous passed it)
        host = target.host or ""
        if _literal(host):  # aiohttp connects to an IP literal without asking the resolver: vet it here
            await self.policy.resolve_host(host, target.port or 0, _itself)
        session = self._session_for(asyncio.get_running_loop())
        async with self._hosts.hold(host), session.get(target, allow_redirects=False) as resp:
            location = resp.headers.get("location")
            if resp.status in _REDIRECT_STATUSES and location:
                return urljoin(str(resp.url), location)
            if not 200 <= resp.status < 300:
                reason = f"{resp.status} {resp.reason or ''}".strip()
                raise MediaError(400, f"could not fetch {shown}: origin returned HTTP {reason}")
            layers = content_layers(resp.headers.get("content-encoding", ""))
            check_layers(layers, shown)
            length = resp.headers.get("content-length", "")  # of the bytes as sent (encoded or not)
            if length.isdigit() and int(length) > max_bytes:
                raise MediaError(413, f"{shown} is {length} bytes, over the limit of {max_bytes}")
            if budget is not None and length.isdigit() and budget.used + int(length) > budget.limit:
                raise MediaError(413, budget.message)
            body = bytearray()
            async for chunk in resp.content.iter_any():  # as sent: never inflated (unbounded) on the event loop
                body += chunk
                if len(body) > max_bytes:
                    raise MediaError(413, f"{shown} is over the size limit of {max_bytes} bytes")
                if budget is not None:
                    budget.take(len(chunk))
        if not layers:
            return bytes(body)
        data = await asyncio.to_thread(inflate, bytes(body), layers[0], max_bytes, shown)
        if budget is not None:
            budget.take(len(data) - len(body))
        return data

    def _read_file(self, url: str) -> bytes:
        path = self.policy.resolve_file(url)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise MediaError(404, f"file not found: {path}") from exc
        except PermissionError as exc:
            raise MediaError(403, f"permission denied reading {path}") from exc
        except OSError as exc:  # e.g. ELOOP: the path was swapped for a symlink after the check
            raise MediaError(403, f"cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MediaError(400, f"{path} is not a regular file")
            if st.st_size > self.limits.max_bytes:
                limit = self.limits.max_bytes
                raise MediaError(413, f"file is {st.st_size} bytes, over the limit of {limit}")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(self.limits.max_bytes + 1)
        if len(data) > self.limits.max_bytes:
            raise MediaError(413, f"file is over the size limit of {self.limits.max_bytes} bytes")
        return data


async def _itself(host: str, port: int) -> list[str]:
    """The lookup of an IP literal: itself."""
    return [host.strip("[]")]


def _tls_context() -> ssl.SSLContext:
    """Verification against certifi's CA bundle; no key log, whatever SSLKEYLOGFILE says."""
    context = ssl.create_default_context(cafile=certifi.where())
    context.keylog_filename = None  # type: ignore[assignment]
    return context


def _describe(exc: BaseException) -> str:
    """Short reason for a transport error, e.g. 'connection refused'; never an address the host resolved to."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return "TLS certificate verification failed"
    if isinstance(exc, aiohttp.ClientSSLError):
        return "TLS handshake failed"
    if isinstance(exc, aiohttp.ClientConnectorError):  # its text names the address it tried: never shown
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused"
        return os.strerror(exc.os_error.errno).lower() if exc.os_error.errno else "could not connect"
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused"
    return text or type(exc).__name__


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    header, _, payload = url.partition(",")
    if header.lower().endswith(";base64"):
        if (len(payload) * 3) // 4 > max_bytes + 3:  # cheap upper bound before decoding anything
            raise MediaError(413, f"data URL payload is over the size limit of {max_bytes} bytes")
        data = _b64decode(payload)
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(413, f"data URL payload is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def _b64decode(payload: str) -> bytes:
    """A data URL's base64 payload decoded strictly (SIMD, pybase64): as sent, or with whitespace dropped and padding
    completed (what clients send too) when that fails; 400 when neither decodes."""
    try:
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    text = "".join(payload.split())
    text += "=" * (-len(text) % 4)
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(400, f"data URL has invalid base64 payload: {exc}") from exc
