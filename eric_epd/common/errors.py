"""The one error every server answers with (ApiError: an HTTP status and a message), its OpenAI-shaped body, and the
bounded JSON body reader that turns an oversized body into a 413 and a malformed one into a 400 naming the problem."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from eric_epd.common.jsonbody import JsonBodyError, decode_struct, parse_json

T = TypeVar("T")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
"""The `type` of an error body by status, as vLLM's OpenAI server and OpenAI's client name them."""


class ApiError(Exception):
    """An error answered to the client as {"error": {...}} with this HTTP status; `param` names the request field at
    fault, `retry_after` (seconds) becomes a Retry-After header."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r})"

    def response(self) -> JSONResponse:
        """This error as the answer to a request."""
        return error_response(self.status, self.message, param=self.param, retry_after=self.retry_after)


def error_type(status: int) -> str:
    """The error body's `type` for `status`: ERROR_TYPES, else BadRequestError for a 4xx, InternalServerError for
    anything else."""
    return ERROR_TYPES.get(status, "BadRequestError" if 400 <= status < 500 else "InternalServerError")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}, the OpenAI/vLLM error shape."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error_response(
    status: int, message: str, *, param: str | None = None, retry_after: float | None = None
) -> JSONResponse:
    """The error body answered with `status`, with Retry-After (whole seconds, at least 1) when given."""
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return JSONResponse(error_body(status, message, param), status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (ApiError 413) past `limit` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


OFF_LOOP_BYTES = 256 * 1024
"""Bodies larger than this are parsed in a worker thread, so the event loop keeps answering other requests."""


def parse_body(body: bytes, kind: type[T] | None = None) -> Any:
    """`body` parsed within jsonbody's bounds, decoded into the msgspec type `kind` when given; ApiError 400 naming
    the problem otherwise."""
    try:
        return parse_json(body) if kind is None else decode_struct(body, kind)
    except JsonBodyError as e:
        raise ApiError(400, str(e)) from e


async def parse_body_off_loop(body: bytes, kind: type[T] | None = None) -> Any:
    """parse_body, in a worker thread for a body over OFF_LOOP_BYTES."""
    if len(body) <= OFF_LOOP_BYTES:
        return parse_body(body, kind)
    return await asyncio.to_thread(parse_body, body, kind)


async def read_json_body(request: Request, limit: int, kind: type[T] | None = None) -> Any:
    """The request's JSON body (decoded into `kind` when given): 413 past `limit` bytes, 400 naming what is wrong."""
    return await parse_body_off_loop(await read_body(request, limit), kind)
