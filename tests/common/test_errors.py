"""The one error module (eric_epd.common.errors): the status -> type map, the OpenAI-shaped body, Retry-After, and
the bounded JSON body reader's 413 and 400s, through a minimal Starlette app."""

from __future__ import annotations

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from eric_epd.common.errors import ApiError, error_body, error_response, error_type, read_json_body

LIMIT = 128


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "BadRequestError"),
        (401, "AuthenticationError"),
        (403, "PermissionDeniedError"),
        (404, "NotFoundError"),
        (405, "MethodNotAllowedError"),
        (409, "ConflictError"),
        (413, "BadRequestError"),
        (418, "BadRequestError"),
        (429, "RateLimitError"),
        (499, "ClientClosedRequestError"),
        (500, "InternalServerError"),
        (501, "InternalServerError"),
        (502, "BadGatewayError"),
        (503, "ServiceUnavailableError"),
        (504, "GatewayTimeoutError"),
    ],
)
def test_error_type(status: int, kind: str) -> None:
    assert error_type(status) == kind


def test_error_body_and_response() -> None:
    assert error_body(404, "no such thing") == {
        "error": {"message": "no such thing", "type": "NotFoundError", "param": None, "code": 404}
    }
    assert error_body(400, "bad size", "size")["error"]["param"] == "size"
    busy = error_response(503, "full", retry_after=0.2)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert "retry-after" not in error_response(400, "bad").headers
    assert ApiError(413, "big").response().status_code == 413


def test_status_carrying_errors_are_api_errors() -> None:
    from eric_epd.media.url_policy import MediaError
    from eric_epd.runtime.engine.client import EngineUnavailableError
    from eric_epd.transfer.pool import LeaseError
    from eric_epd.transfer.producer import PoolFullError

    for error in (MediaError(415, "m"), LeaseError(404, "l"), EngineUnavailableError(503, "e")):
        assert isinstance(error, ApiError) and error.response().status_code == error.status
    full = PoolFullError("pool full")
    assert isinstance(full, ApiError) and (full.status, full.retry_after) == (503, 1.0)
    assert repr(MediaError(400, "bad")) == "MediaError(400, 'bad')"


class Point(msgspec.Struct, forbid_unknown_fields=True):
    x: int


async def _plain(request: Request) -> Response:
    return JSONResponse({"got": await read_json_body(request, LIMIT)})


async def _typed(request: Request) -> Response:
    return JSONResponse({"x": (await read_json_body(request, LIMIT, Point)).x})


async def _on_api_error(_: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return e.response()


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = Starlette(
        routes=[Route("/plain", _plain, methods=["POST"]), Route("/typed", _typed, methods=["POST"])],
        exception_handlers={ApiError: _on_api_error},
    )
    return TestClient(app)


def test_read_json_body_reads_within_the_limit(client: TestClient) -> None:
    assert client.post("/plain", content=b'{"a": [1, 2]}').json() == {"got": {"a": [1, 2]}}
    assert client.post("/typed", content=b'{"x": 3}').json() == {"x": 3}


def test_read_json_body_refuses_an_oversized_body(client: TestClient) -> None:
    r = client.post("/plain", content=b"[" + b"1," * LIMIT + b"1]")
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == 413 and error["type"] == "BadRequestError" and f"limit of {LIMIT} bytes" in error["message"]


def test_read_json_body_refuses_an_oversized_stream(client: TestClient) -> None:
    """No Content-Length: the limit is enforced while the body streams in."""
    r = client.post("/plain", content=iter([b"[1,", b"2," * LIMIT, b"3]"]))
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "names"),
    [
        ("/plain", b'{"a": ', "malformed JSON body"),
        ("/plain", b"[" * 40 + b"]" * 40, "nested deeper than"),
        ("/typed", b'{"x": "three"}', "$.x"),
        ("/typed", b'{"x": 1, "y": 2}', "y"),
    ],
)
def test_read_json_body_names_what_is_wrong(client: TestClient, path: str, body: bytes, names: str) -> None:
    r = client.post(path, content=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and names in error["message"]
