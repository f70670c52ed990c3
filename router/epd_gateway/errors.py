"""Errors answered the way vLLM's OpenAI server answers them."""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "BadRequestError",
          502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


class GatewayError(Exception):
    """A request's failure, answered with `status` in vLLM's OpenAI error shape."""
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        """The error as vLLM's OpenAI server answers it (a bare "Unauthorized" for 401)."""
        if self.status == 401:  # vLLM's API-key check answers exactly this
            return JSONResponse({"error": "Unauthorized"}, 401)
        body = {"error": {"message": self.message, "type": _TYPES.get(self.status, "InternalServerError"),
                          "param": self.param, "code": self.status}}
        return JSONResponse(body, self.status)
