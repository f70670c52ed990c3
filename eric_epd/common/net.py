"""Host network facts the transfer backends need: which interface carries an address."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_of(host: str) -> str | None:
    """The network interface whose (primary IPv4) address is `host`'s, or None when no interface here has it."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def is_loopback(host: str) -> bool:
    """True for a loopback name or address (localhost, 127.0.0.0/8, ::1); names are resolved."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False
