"""The URL policy's verdict on hosts written as literals (IPv4, and IPv6 by an allowlist of global unicast, IPv4
inside IPv6 judged as IPv4) and on URL length, checked before any parsing; no network I/O."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from eric_epd.media.url_policy import MediaError, UrlPolicy


def _error(fn: Callable[[], object]) -> MediaError:
    with pytest.raises(MediaError) as info:
        fn()
    return info.value


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3/a",
        "http://169.254.169.254/latest",
        "http://[::1]/a",
        "http://[::ffff:127.0.0.1]/a",
        "http://0.0.0.0/a",
        "http://[fe80::1]/a",
        "http://100.64.0.1/a",
        "http://224.0.0.1/a",
        "http://[64:ff9b:1::a00:1]/a",  # local-use NAT64 (RFC 8215)
        "http://[64:ff9b:1::5db8:d822]/a",  # ... even around a public IPv4 address
        "http://[::ffff:0:5db8:d822]/a",  # IPv4-translated (RFC 2765)
        "http://[fec0::1]/a",  # deprecated site-local
        "http://[::5db8:d822]/a",  # deprecated IPv4-compatible
        "http://[2001:db8::1]/a",  # documentation, inside 2000::/3
        "http://[100::1]/a",  # discard-only
    ],
)
def test_policy_refuses_non_public_ip_literals(url: str) -> None:
    err = _error(lambda: UrlPolicy().check(url))
    assert err.status == 400 and "private" in err.message
    UrlPolicy(allow_private_hosts=True).check(url)


def test_policy_accepts_public_and_names() -> None:
    UrlPolicy().check("https://93.184.216.34/a.png")
    UrlPolicy().check("https://[2606:2800:220:1:248:1893:25c8:1946]/a.png")  # global unicast
    UrlPolicy().check("https://[64:ff9b::5db8:d822]/a.png")  # NAT64's well-known prefix around a public IPv4
    UrlPolicy().check("https://[::ffff:93.184.216.34]/a.png")  # IPv4-mapped public


def test_policy_checks_url_length_before_parsing() -> None:
    long = "https://example.com/" + "a" * 60_000_000
    err = _error(lambda: UrlPolicy().check(long))
    assert err.status == 400 and "over the limit of 8192" in err.message
    UrlPolicy().check("https://example.com/" + "a" * 8000)
    UrlPolicy().check("data:image/png;base64," + "A" * 100_000)  # data: URLs are bounded by the body instead
    UrlPolicy().check("https://example.com/a.png")  # names are vetted at connect time
