"""Errors the gateway turns into OpenAI's error shape; each class fixes the HTTP status and gRPC code."""

from __future__ import annotations

from http import HTTPStatus


class GatewayError(Exception):
    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(GatewayError):
    status = HTTPStatus.BAD_REQUEST
    type = "invalid_request_error"

    @classmethod
    def from_value_error(cls, err: ValueError) -> BadRequest:
        """shared.sampling_params and the engines phrase errors as '<field>: <what is wrong>'."""
        text = str(err)
        head, sep, _ = text.partition(":")
        param = head.strip() if sep and head.strip().replace("_", "").isalnum() else None
        return cls(text, param=param)


class Unauthorized(GatewayError):
    status = HTTPStatus.UNAUTHORIZED
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = HTTPStatus.NOT_FOUND
    type = "not_found_error"


class ModelNotFound(NotFound):
    type = "invalid_request_error"
    code = "model_not_found"


class NoCapacity(GatewayError):
    """No node can take the request now: none up, or every reservation refused."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "service_unavailable_error"


class NodeFailure(GatewayError):
    """A node failed mid-request for a reason that is not the caller's (maps to 502 before any output)."""

    status = HTTPStatus.BAD_GATEWAY
    type = "upstream_error"


class ShuttingDown(NoCapacity):
    code = "shutting_down"
