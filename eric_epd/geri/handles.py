"""Prompt embeddings Geri takes by transfer handle: checked against its configured producers and the model's width,
then read over the best backend the handle offers (shm, NIXL, Mooncake, HTTP) and acknowledged."""

from __future__ import annotations

import asyncio

import numpy as np

from eric_epd.common.errors import ApiError
from eric_epd.geri.body import float_rows, inline_embeddings
from eric_epd.transfer.backends.base import TransferError
from eric_epd.transfer.client import EmbeddingFetcher
from eric_epd.wire.geri import GenerateBody
from eric_epd.wire.handles import EmbeddingHandle, HandleError, check_handle


class HandleReader:
    """One per router; without producers every handle is refused (400)."""

    def __init__(
        self, producers: tuple[str, ...], api_key: str | None, backends: tuple[str, ...], hidden: int, max_rows: int
    ) -> None:
        self._producers = producers
        self._hidden = hidden
        self._max_rows = max_rows
        """GeriLimits.max_prompt_tokens: a longer handle is refused before anything is allocated for it."""
        self._fetcher = EmbeddingFetcher(backends, api_key=api_key) if producers else None

    async def read(self, name: str, handle: EmbeddingHandle) -> np.ndarray:
        """The handle's [tokens, hidden] rows as float32; 400 for a handle this Geri must not use, 404 for one its
        producer does not hold (unknown, expired or already read), 503 for a producer it cannot reach."""
        if self._fetcher is None:
            raise ApiError(400, f"{name}: this Geri takes no embedding handles (start it with --embedding-producers)")
        try:
            check_handle(handle, self._producers, self._hidden)
        except HandleError as e:
            raise ApiError(400, f"{name}: {e}") from e
        if handle.shape[0] > self._max_rows:  # the fetch allocates the shape it names
            raise ApiError(400, f"{name} has {handle.shape[0]} tokens; 1 to {self._max_rows} accepted")
        try:
            tensor = await asyncio.to_thread(self._fetcher.fetch, handle)
        except HandleError as e:  # a location that is not its producer's own: nothing was read
            raise ApiError(400, f"{name}: {e}") from e
        except TransferError as e:
            gone = "answered 404" in str(e) or "no longer valid" in str(e)
            raise ApiError(404 if gone else 503, f"{name}: {e}") from e
        return float_rows(name, tensor)

    def close(self) -> None:
        """Close the embedding fetcher, if this Geri has one."""
        if self._fetcher is not None:
            self._fetcher.close()


async def embeddings_of(raw: GenerateBody, reader: HandleReader) -> tuple[np.ndarray, np.ndarray | None]:
    """The prompt's and the negative prompt's rows, inline or by handle."""
    if raw.embeddings is not None:  # base64 safetensors, decoded and checked off the event loop
        return await asyncio.to_thread(inline_embeddings, raw.embeddings)
    assert raw.prompt_handle is not None
    negative = raw.negative_handle
    prompt, negative_rows = await asyncio.gather(
        reader.read("prompt_handle", raw.prompt_handle),
        reader.read("negative_handle", negative) if negative is not None else _none(),
        return_exceptions=True,
    )
    for outcome in (prompt, negative_rows):  # both reads end first; the error named is the first field's, always
        if isinstance(outcome, BaseException):
            raise outcome
    assert isinstance(prompt, np.ndarray)
    return prompt, negative_rows  # type: ignore[return-value]


async def _none() -> None:
    return None
