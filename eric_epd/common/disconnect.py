"""Cancel a route's work when its client disconnects: Starlette does not, so an abandoned request would otherwise
run to the end and keep what it took (pool space, leases, upstream calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnectedError(Exception):
    """The client went away before the answer was ready; the work was cancelled and has cleaned up."""


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client disconnects. Only after the body was read: every message left is a disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` (after the body was read) while watching the connection; if the client disconnects first, cancel
    the work, wait for its cleanup to finish, and raise ClientDisconnectedError. A result that is already there wins
    (a streamed response returned just before the disconnect is the caller's to close)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the route itself was cancelled (server shutdown)
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    if watcher.exception() is not None:  # not a disconnect: the connection cannot be watched, so just wait
        return await task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its cleanup (aborts, lease returns) runs to the end
    if not task.cancelled() and task.exception() is None:
        return task.result()
    raise ClientDisconnectedError("client disconnected")
