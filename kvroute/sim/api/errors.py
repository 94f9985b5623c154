"""Errors in vLLM's OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client in vLLM's shape (`code` is the HTTP status)."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """The error as vLLM's JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400, vLLM's BadRequestError."""
    return ApiError(message, HTTPStatus.BAD_REQUEST, "BadRequestError", param)


def not_found(message: str, param: str | None = None) -> ApiError:
    """404, vLLM's NotFoundError."""
    return ApiError(message, HTTPStatus.NOT_FOUND, "NotFoundError", param)


def server_error(message: str) -> ApiError:
    """500, vLLM's InternalServerError."""
    return ApiError(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
