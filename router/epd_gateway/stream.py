"""A streamed answer (SSE) relayed to a client that must keep reading: a write the client does not take within the
write timeout ends the stream and releases the upstream one, so a reader that stops reading holds nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

logger = logging.getLogger(__name__)


class ClientTooSlowError(Exception):
    """A streamed chunk was not taken by the client within the write timeout."""


class TimedStream(StreamingResponse):
    """StreamingResponse whose every write must complete within `write_timeout_s`; the body iterator is closed
    however the stream ends (its aclose releases the upstream response)."""

    def __init__(
        self, content: AsyncIterator[bytes], status_code: int, headers: Mapping[str, str] | None, write_timeout_s: float
    ) -> None:
        super().__init__(content, status_code, headers=headers)
        self._write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        """Starlette's streaming, each send bounded in time."""

        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._write_timeout_s)
            except TimeoutError as e:
                logger.warning("a streaming client took no data for %.0f s: stream closed", self._write_timeout_s)
                raise ClientTooSlowError from e

        try:
            await super().stream_response(timed)
        except ClientTooSlowError:
            pass
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
