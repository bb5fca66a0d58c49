"""Errors the gateway turns into OpenAI's error shape; each class fixes the HTTP status and gRPC code."""

from __future__ import annotations

from http import HTTPStatus


class GatewayError(Exception):
    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR
    type: str = "internal_error"
    code: str | None = None
    retry_after: int | None = None  # seconds, sent as Retry-After
    extra_headers: dict[str, str] | None = None  # more headers for the answer (a key's x-ratelimit-*)

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after is not None:
            self.retry_after = retry_after

    def body(self) -> dict:
        """OpenAI's error body (an HTTP answer, a stream's last event)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """The answer's headers (HTTP) or trailing metadata (gRPC): Retry-After and any extra ones."""
        out = dict(self.extra_headers or {})
        if self.retry_after is not None:
            out["Retry-After"] = str(self.retry_after)
        return out


class BadRequest(GatewayError):
    status = HTTPStatus.BAD_REQUEST
    type = "invalid_request_error"

    @classmethod
    def from_value_error(cls, err: ValueError) -> BadRequest:
        """kvrelay.common.sampling_params and the engines phrase errors as '<field>: <what is wrong>'."""
        text = str(err)
        head, sep, _ = text.partition(":")
        param = head.strip() if sep and head.strip().replace("_", "").isalnum() else None
        return cls(text, param=param)


class Unauthorized(GatewayError):
    status = HTTPStatus.UNAUTHORIZED
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    """A valid key that may not do this (another tenant's model, an admin route)."""

    status = HTTPStatus.FORBIDDEN
    type = "permission_error"
    code = "forbidden"


class PayloadTooLarge(GatewayError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    """A key past its requests or tokens per minute (gateway.ratelimit); `type` says which, as OpenAI's does."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, kind: str, retry_after: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, retry_after=retry_after)
        self.type = kind
        self.extra_headers = headers


class NotFound(GatewayError):
    status = HTTPStatus.NOT_FOUND
    type = "not_found_error"


class RunGone(NotFound):
    """A keyed request's record named a node that no longer keeps it (it ended long ago, or was aborted)."""

    code = "stream_not_found"


class ModelNotFound(NotFound):
    type = "invalid_request_error"
    code = "model_not_found"


class NoCapacity(GatewayError):
    """No node can take the request now: none up within the wait, or none reachable."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    type = "service_unavailable_error"
    code = "no_capacity"
    retry_after = 5


class Overloaded(GatewayError):
    """Every queue that could hold the request is at its bound (the gateway's or the nodes')."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    type = "rate_limit_error"
    code = "overloaded"
    retry_after = 1


class RequestTimeout(GatewayError):
    """The request passed its deadline (--request-timeout); it was aborted on every node."""

    status = HTTPStatus.GATEWAY_TIMEOUT
    type = "timeout_error"
    code = "request_timeout"


class NodeFailure(GatewayError):
    """A node failed under a request for a reason that is not the caller's, and the request could not move
    on to another node (maps to 502 before any output). `node_id`: the node that failed, if one did."""

    status = HTTPStatus.BAD_GATEWAY
    type = "upstream_error"

    def __init__(self, message: str, code: str | None = None, node_id: str | None = None) -> None:
        super().__init__(message, code=code)
        self.node_id = node_id


class ShuttingDown(NoCapacity):
    code = "shutting_down"
    retry_after = 1
