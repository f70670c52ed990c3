"""Where Eric may connect on SGLang's encoder protocol: the address the HTTP request came from, or inside the
operator's --sglang-allowed-peer CIDRs. SGLang's receivers send no credentials, so this bounds every push."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable

import msgspec

from eric_epd.common.jsonbody import clip
from eric_epd.eric.sglang.protocol import MAX_RANKS, SglangError, host_port
from eric_epd.wire.sglang import EncodeRequest, NixlSession, SendRequest, decode_nixl_session

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
RESOLVE_TIMEOUT_S = 5.0


def as_ip(address: str | None) -> IPAddress | None:
    """The IP in a textual address (brackets and IPv6 zone dropped, IPv4-mapped IPv6 unmapped); None if not one."""
    if not address:
        return None
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


async def _resolve(host: str, what: str) -> list[str]:
    """Every address `host` resolves to (asyncio getaddrinfo, bounded in time); 400 if it does not resolve."""
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
        )
    except (TimeoutError, OSError, UnicodeError) as e:
        raise SglangError(400, f"{what}: cannot resolve host {host!r}: {type(e).__name__}: {e}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise SglangError(400, f"{what}: host {host!r} resolves to no address")
    return addresses


class PeerPolicy:
    """Checks a request's push targets against its caller's address and the allowlist, before any connection.

    A target host is allowed when every address it resolves to is the caller's own address or inside an allowed
    network (loopback is no exception). The checked address is what Eric connects to, so a name cannot resolve
    differently later. A part's later callers (its ranks) must come from the part's /encode caller's address or
    from inside the allowlist. Not covered: the UCX addresses inside a NIXL session (packed in UCX's private
    format); only that rank's notification host is checked.
    """

    def __init__(self, networks: Iterable[Network]) -> None:
        self.networks = tuple(networks)
        """SglangConfig.peer_networks: --sglang-allowed-peer, parsed and validated at start."""

    def allows(self, ip: IPAddress, caller: str | None) -> bool:
        """Whether `ip` is the caller's own address or inside an allowed network."""
        return ip == as_ip(caller) or any(ip in net for net in self.networks)

    def allows_caller(self, caller: str | None, owner: str | None) -> bool:
        """Whether `caller` may act on a part first posted (/encode) from `owner` (None: not posted yet)."""
        if owner is None or caller == owner:
            return True
        ip = as_ip(caller)
        return ip is not None and (ip == as_ip(owner) or any(ip in net for net in self.networks))

    def check_nixl_caller(self, caller: str | None) -> None:
        """403 unless the caller is inside --sglang-allowed-peer (a NIXL session's UCX addresses cannot be checked)."""
        ip = as_ip(caller)
        if ip is None or not any(ip in net for net in self.networks):
            logger.warning("SGLang: refused a NIXL session from %s (outside --sglang-allowed-peer)", caller)
            raise SglangError(
                403,
                f"a NIXL session_id is accepted only from callers inside --sglang-allowed-peer; "
                f"{caller} is not (its UCX addresses are opaque to Eric and could name any host)",
            )

    def check_caller(self, caller: str | None, owner: str | None, req_id: str) -> None:
        """403 unless `caller` may act on the part `owner` posted (see `allows_caller`)."""
        if not self.allows_caller(caller, owner):
            logger.warning("SGLang: refused %s acting on req_id=%s posted from %s", caller, req_id, owner)
            raise SglangError(
                403,
                f"req_id={req_id} was posted from another address; {caller} may not act on it "
                "(see --sglang-allowed-peer)",
            )

    async def host(self, host: str, caller: str | None, what: str) -> str:
        """The address to connect to for `host`; 403 unless every address it resolves to is allowed."""
        name = host.strip("[]")
        if not name:
            raise SglangError(400, f"{what}: empty host")
        literal = as_ip(name)
        addresses = [name] if literal is not None else await _resolve(name, what)
        for address in addresses:
            ip = as_ip(address)
            if ip is None or not self.allows(ip, caller):
                logger.warning("SGLang: refused %s %s (%s) for caller %s", what, host, address, caller)
                raise SglangError(
                    403,
                    f"{what} {host} ({address}) is neither the caller's address ({caller}) nor "
                    "inside --sglang-allowed-peer; Eric does not connect there",
                )
        return addresses[0]

    async def endpoint(self, endpoint: str, caller: str | None, what: str) -> str:
        """ "host:port" with the host checked and replaced by the address to connect to."""
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SglangError(400, f"bad {what} {endpoint!r}; expected host:port")
        return host_port(await self.host(host, caller, what), int(port))

    async def encode_target(self, req: EncodeRequest, caller: str | None) -> EncodeRequest:
        """zmq_to_tokenizer's /encode: prefill_host checked (403 before anything is encoded) and replaced by the
        address Eric pushes to; other /encode bodies name no target."""
        if req.embedding_port is None:
            return req
        if not req.prefill_host:
            raise SglangError(400, "embedding_port given without prefill_host")
        listed = isinstance(req.embedding_port, list)
        ports = list(dict.fromkeys(req.embedding_port)) if listed else [req.embedding_port]  # each rank once
        if not ports or not all(0 < p < 65536 for p in ports):
            raise SglangError(400, f"bad embedding_port {clip(req.embedding_port)}")
        if len(ports) > MAX_RANKS:
            raise SglangError(400, f"embedding_port lists {len(ports)} ports; at most {MAX_RANKS} ranks")
        address = await self.host(req.prefill_host, caller, "prefill_host")
        return msgspec.structs.replace(req, prefill_host=address, embedding_port=ports if listed else ports[0])

    async def send_targets(self, req: SendRequest, caller: str | None) -> tuple[str, str, NixlSession | None]:
        """/send: the rank's ZMQ endpoint and its Mooncake session (host:rpc_port), hosts checked and replaced by
        their addresses; or its NIXL session, taken only from a caller inside the allowlist (its UCX connection
        info is opaque to Eric: from anyone else it could name any host)."""
        endpoint = await self.endpoint(host_port(req.prefill_host, req.embedding_port), caller, "prefill_host")
        try:
            nixl = decode_nixl_session(req.session_id)
        except Exception as e:
            raise SglangError(400, f"bad NIXL session_id: {type(e).__name__}: {e}") from None
        if nixl is not None:
            self.check_nixl_caller(caller)
            return endpoint, req.session_id, nixl
        return endpoint, await self.endpoint(req.session_id, caller, "mooncake session"), None
