"""What a client may read of an internal failure: URLs and network addresses in 5xx texts become `<internal>`
(the full text goes to the gateway's log), so an error never maps the cluster behind the gateway."""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)

_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>)\]}]+", re.IGNORECASE)
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?(?![\w.])")
_IPV6 = re.compile(
    r"\[[0-9a-f:.%]+\](?::\d{1,5})?|(?<![\w:])(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}(?![\w:])", re.IGNORECASE
)
_HOST_PORT = re.compile(r"(?<![\w.-])(?:[a-z0-9-]+\.)*[a-z][a-z0-9-]*:\d{2,5}(?!\d)", re.IGNORECASE)
INTERNAL = "<internal>"


def redact(text: str) -> str:
    """`text` with every URL, IP address and host:port replaced by `<internal>`."""
    for pattern in (_URL, _IPV6, _IPV4, _HOST_PORT):
        text = pattern.sub(INTERNAL, text)
    return text


def for_client(status: int, text: str) -> str:
    """The text of an error answered with `status`: a 5xx (an internal failure) redacted and its original logged;
    a 4xx (about the client's own request, its own URLs included) as it is."""
    if status < 500:
        return text
    shown = redact(text)
    if shown != text:
        logger.warning("answered %d; internal detail kept here: %s", status, text)
    return shown
