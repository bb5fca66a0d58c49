"""What every HTTP request passes before the API sees it: its id, its key, its size and its rate limits.

Plain ASGI middleware (no per-request cost beyond the checks), in this order:
- `RequestIdMiddleware`: echoes a valid X-Request-Id on the response; refuses an unusable one (400).
- `GuardMiddleware`, once keys exist (gateway.auth): every route but /health (and /metrics with --public-metrics)
  needs 'Authorization: Bearer <key>': 401 without one or with a wrong one, before the body is read, so a caller
  without a key learns nothing about the API. The principal it finds is `auth.current_principal` for the request.
  A body over --max-body-bytes is a 413 (by Content-Length before reading, and while reading for a chunked body).
  A generation (chat, completions) then takes one request from the key's rate limits (gateway.ratelimit): a
  429 with Retry-After past them; every answer to a limited key carries the x-ratelimit-* headers. A client's
  W3C `traceparent` header makes the request's trace a child of the client's (kvrelay.common.tracing).
"""

from __future__ import annotations

import json

from kvrelay.common.tracing import incoming_traceparent
from kvrelay.gateway.auth import KeyStore, current_principal
from kvrelay.gateway.errors import BadRequest, GatewayError, PayloadTooLarge
from kvrelay.gateway.ratelimit import RateDecision, RateLimiter, current_rate

MAX_REQUEST_ID = 128
_OPEN = ("/health",)
_GENERATION = ("/v1/chat/completions", "/v1/completions")


async def send_error(err: GatewayError, send) -> None:
    """Answer with `err` from the middleware, before the app (plain ASGI)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in err.headers().items())]
    await send({"type": "http.response.start", "status": int(err.status), "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if raw is None:
            await self.app(scope, receive, send)
            return
        value = raw.decode("latin-1")
        if not 0 < len(value) <= MAX_REQUEST_ID or not value.isprintable():
            await send_error(BadRequest(f"X-Request-Id: must be 1 to {MAX_REQUEST_ID} printable characters",
                                        param="X-Request-Id"), send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", raw)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class GuardMiddleware:
    """`on_refused(error)`: counts a refused request in the gateway's metrics (serving_common.observe_error)."""

    def __init__(self, app, keys: KeyStore, limiter: RateLimiter, max_body_bytes: int, public_metrics: bool,
                 on_refused=lambda error: None) -> None:
        self.app = app
        self.keys, self.limiter = keys, limiter
        self.max_body_bytes = max_body_bytes
        self.open = _OPEN + (("/metrics",) if public_metrics else ())
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            principal = self.keys.authenticate(headers.get(b"authorization"))
            self._check_length(headers.get(b"content-length"))
            decision = RateDecision(None, None)
            if scope["path"] in _GENERATION and scope["method"] == "POST":
                decision = await self.limiter.admit(principal)
        except GatewayError as err:
            self.on_refused(err)
            await send_error(err, send)
            return
        token, rate_token = current_principal.set(principal), current_rate.set(decision)
        parent = headers.get(b"traceparent")
        trace_token = incoming_traceparent.set(parent.decode("latin-1")[:64]) if parent else None
        extra = [(k.encode(), v.encode()) for k, v in decision.headers().items()]
        try:
            await self.app(scope, self._limited(receive) if self.max_body_bytes else receive,
                           self._with_headers(send, extra) if extra else send)
        finally:
            current_principal.reset(token)
            current_rate.reset(rate_token)
            if trace_token is not None:
                incoming_traceparent.reset(trace_token)

    def _check_length(self, raw: bytes | None) -> None:
        if raw is None or not self.max_body_bytes:
            return
        try:
            length = int(raw)
        except ValueError:
            raise BadRequest("Content-Length: not a number", param="Content-Length") from None
        if length > self.max_body_bytes:
            raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {self.max_body_bytes} "
                                  "(--max-body-bytes)")

    def _limited(self, receive):
        seen = 0
        limit = self.max_body_bytes

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise PayloadTooLarge(f"the request body exceeds {limit} bytes (--max-body-bytes)")
            return message

        return limited

    @staticmethod
    def _with_headers(send, extra: list[tuple[bytes, bytes]]):
        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return with_headers
