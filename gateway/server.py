"""The OpenAI-compatible HTTP API (FastAPI), and `serve()`: HTTP + optional gRPC on one event loop.

A request's `model` picks the base model, or the LoRA adapter, it runs with (gateway.models); an unknown one is a
404 with code `model_not_found`. POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies) load and
unload an adapter across the fleet (gateway.adapters), behind the API key like the rest of /v1.

Every error, bad input included, leaves in OpenAI's shape {"error": {message, type, param, code}}: pydantic
validation errors are 400s (OpenAI's convention), not FastAPI's 422s. An X-Request-Id header names the
request (its id in the response and on the nodes) and comes back on the response, errors included. CORS
headers are sent for the --allowed-origins only.

SIGTERM: new requests get 503 with Retry-After (the port stays open meanwhile, so a client learns why), open
requests get --shutdown-grace to finish; past it each still open ends as a shutdown (GatewayCore.cut): a
stream with a final error event in OpenAI's shape and [DONE], a plain request with a 503, and its sequences are
aborted on the nodes. Then the port closes and the gateway's parts stop. Nothing is left for uvicorn to cancel,
so no traceback is logged.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from kvrelay.common import tracing
from kvrelay.common.system import is_loopback
from kvrelay.gateway.auth import check_admin, check_model, current_principal
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.http_guard import GuardMiddleware, RequestIdMiddleware
from kvrelay.gateway.metrics import CONTENT_TYPE
from kvrelay.gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthNode,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from kvrelay.gateway.runtime import Gateway
from kvrelay.gateway.serving_common import observe_error
from kvrelay.gateway.serving_embeddings import EmbeddingRequest, EmbeddingResponse
from kvrelay.gateway.serving_scores import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse, ScoreServing

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse}
                                             for code in (400, 401, 403, 404, 413, 429, 502, 503, 504)}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}
_CUT_S = 3.0  # after cut(): how long the requests it ended get to send their last event


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None,
                   retry_after: int | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def build_app(gateway: Gateway, grpc_port: int | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        grpc_server = None
        if grpc_port is not None:
            from kvrelay.gateway.grpc_api import start_grpc_server

            grpc_server = await start_grpc_server(gateway, gateway.config.host, grpc_port)
        app.state.grpc_server = grpc_server
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1.0)
            await gateway.stop()

    app = FastAPI(title="kvrelay gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over disaggregated prefill and decode pools")
    app.state.gateway = gateway
    _install_error_handlers(app, gateway)
    cfg = gateway.config
    app.add_middleware(GuardMiddleware, keys=gateway.keys, limiter=gateway.limiter,
                       max_body_bytes=cfg.max_body_bytes, public_metrics=cfg.public_metrics,
                       on_refused=lambda error: observe_error(gateway.metrics, error))
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(CloseAfterResponse, gateway=gateway)
    if cfg.allowed_origins:  # outermost: a browser's preflight must not need the API key
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
                           allow_credentials=cfg.allow_credentials, expose_headers=["X-Request-Id"])
    app.include_router(_openai_routes(gateway))
    app.include_router(_ops_routes(gateway))
    app.include_router(_tokenize_routes(gateway))
    app.router.routes[0:0] = _fast_routes(gateway)
    return app


def _install_error_handlers(app: FastAPI, gateway: Gateway) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError):
        observe_error(gateway.metrics, exc)
        return JSONResponse(exc.body(), status_code=int(exc.status), headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        gateway.metrics.observe_request("client_error")
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        gateway.metrics.observe_request("node_error")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


def header_request_id(request: Request) -> str | None:
    return request.headers.get("x-request-id") or None


def _tokenize_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    def serving(model: str | None):
        return resolve(gateway, model).endpoint.tokenize

    @router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        return Response(serving(body.model).tokenize(body).model_dump_json(exclude_none=True),
                        media_type="application/json")

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        return serving(body.model).detokenize(body)

    @router.get("/version", response_model=VersionResponse)
    async def version():
        return gateway.tokenize.version()

    return router


def _openai_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        created = int(gateway.started_at)
        principal = current_principal.get()
        return ModelList(data=[ModelCard(created=created, **card) for card in gateway.models.cards()
                               if principal is None or principal.may_use(card["id"])])

    @router.post("/chat/completions", response_model=ChatCompletionResponse,
                 responses={**_ERRORS, 200: {"content": _SSE}})
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _respond(gateway, request, _chat(gateway, body, request))

    @router.post("/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: {"content": _SSE}})
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(gateway, request, _completions(gateway, body, request))

    @router.post("/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request):
        gateway.input_limits.check_texts(body.input, "input")
        target = resolve(gateway, body.model)
        return await _respond(gateway, request, target.endpoint.embeddings.create(body, target,
                                                                                 header_request_id(request)))

    @router.post("/score", response_model=ScoreResponse, responses=_ERRORS)
    async def score(body: ScoreRequest, request: Request):
        gateway.input_limits.check_texts(body.text_1, "text_1")
        gateway.input_limits.check_texts(body.text_2, "text_2")
        target = resolve(gateway, body.model)
        return await _respond(gateway, request, ScoreServing(target.endpoint.embeddings).score(
            body, target, header_request_id(request)))

    @router.post("/rerank", response_model=RerankResponse, responses=_ERRORS)
    async def rerank(body: RerankRequest, request: Request):
        gateway.input_limits.check_texts([body.query, *body.documents], "documents")
        target = resolve(gateway, body.model)
        return await _respond(gateway, request, ScoreServing(target.endpoint.embeddings).rerank(
            body, target, header_request_id(request)))

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        check_admin(current_principal.get())
        base = gateway.models.base_model_id(body.base_model_name) if body.base_model_name else None
        await gateway.adapters.load(body.lora_name, body.lora_path, gateway.served_names, base)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        check_admin(current_principal.get())
        await gateway.adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def resolve(gateway: Gateway, model: str | None):
    """What `model` names, if the caller's key may use it (404 unknown, 403 not this key's)."""
    target = gateway.models.resolve(model)
    check_model(current_principal.get(), target.name)
    return target


def _chat(gateway: Gateway, body: ChatCompletionRequest, request: Request) -> Awaitable:
    gateway.input_limits.check_chat(body)
    target = resolve(gateway, body.model)
    # A request sent again under the same key gets the first copy's answer or stream (gateway.idempotency).
    return gateway.idempotency.answer(request, body.stream,
                                      lambda: target.endpoint.chat.create(body, target, header_request_id(request)))


def _completions(gateway: Gateway, body: CompletionRequest, request: Request) -> Awaitable:
    gateway.input_limits.check_completion(body)
    target = resolve(gateway, body.model)
    return gateway.idempotency.answer(
        request, body.stream, lambda: target.endpoint.completions.create(body, target, header_request_id(request)))


def _fast_routes(gateway: Gateway) -> list[Route]:
    """The generation endpoints again, as plain Starlette routes matched before FastAPI's (which stay for the
    OpenAPI schema and docs): FastAPI's request machinery costs ~0.1 ms, a real share of the gateway's TTFT.
    Same models, same validation, same 400s."""

    async def chat(request: Request):
        body = _parse(ChatCompletionRequest, await request.body())
        return await _respond(gateway, request, _chat(gateway, body, request))

    async def completions(request: Request):
        body = _parse(CompletionRequest, await request.body())
        return await _respond(gateway, request, _completions(gateway, body, request))

    return [Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"])]


def _parse(model, raw: bytes):
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _ops_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health():
        nodes = gateway.discovery.nodes()
        views = [HealthNode(node_id=n.node_id, role=n.kind, address=n.address, source=n.source,
                            routable=n.routable, reason=n.refused or (None if n.healthy else "unhealthy"),
                            breaker=gateway.discovery.breaker_state(n.node_id))
                 for n in nodes]
        prefill = sum(n.routable and n.role == "prefill" for n in nodes)
        decode = sum(n.routable and n.role == "decode" for n in nodes)
        colocated = sum(n.routable and n.kind == "colocated" for n in nodes)
        reasons = gateway.health_reasons()
        if not decode:
            reasons.insert(0, "no decode node is routable")
        status = "draining" if gateway.core.draining else "degraded" if reasons else "ok"
        body = HealthResponse(status=status, prefill_nodes=prefill, decode_nodes=decode, colocated_nodes=colocated,
                              nodes=views, reasons=reasons)
        # Degraded but serving (Redis down, a node out) is still 200: a load balancer must keep sending work.
        code = 200 if decode and not gateway.core.draining else 503
        return JSONResponse(body.model_dump(), status_code=code)

    @router.get("/metrics", response_class=Response)
    async def metrics():
        fleet = gateway.fleet_metrics
        return Response(await fleet.render() if fleet is not None else gateway.metrics.render(),
                        media_type=CONTENT_TYPE)

    return router


async def _respond(gateway: Gateway, request: Request, work: Awaitable):
    """Run a request; a client that hangs up before the answer cancels it (and so aborts it on the nodes)."""
    task = asyncio.current_task()
    gone = asyncio.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, task, gone))
    try:
        result = await work
    except asyncio.CancelledError:
        cut = None if gone.is_set() else gateway.core.cut_error()
        if not gone.is_set() and cut is None:
            raise
        task.uncancel()
        if cut is not None:  # a shutdown's grace ran out before the generation started
            raise cut from None
        gateway.metrics.observe_request("cancelled")
        return Response(status_code=499)
    finally:
        watcher.cancel()
    gateway.metrics.observe_request("success")
    return result  # a stream watches for disconnects itself


async def _cancel_on_disconnect(request: Request, task: asyncio.Task, gone: asyncio.Event) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()
    task.cancel()


# ---------------------------------------------------------------------------------------------- serve


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.handing_over = False  # SIGUSR1: a rolling restart's successor has the ports
        self._grpc_stop: asyncio.Future | None = None

    @contextmanager
    def capture_signals(self):
        # uvicorn re-raises SIGTERM after its shutdown; a drained gateway exits 0, like the nodes.
        with super().capture_signals():
            hand_over = (signal.signal(signal.SIGUSR1, self._on_hand_over)
                         if self.gateway.config.reuse_port and threading.current_thread() is threading.main_thread()
                         else None)
            try:
                yield
            finally:
                if hand_over is not None:
                    signal.signal(signal.SIGUSR1, hand_over)
            self._captured_signals.clear()

    def _on_hand_over(self, signum, frame) -> None:
        """SIGUSR1 (with --reuse-port): a successor listens on the ports; drain as on SIGTERM, but stop listening
        first (a plain SIGTERM keeps the port open, answering 503, since nobody else may be there)."""
        self.handing_over = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        core, grace = self.gateway.core, self.gateway.config.shutdown_timeout
        if self.handing_over:
            self._hand_over_ports(grace)
        else:  # new requests get 503 with Retry-After; the port stays open until the drain ends
            core.draining = True
        if core.active:
            logger.info("shutting down: %s; %d generations in progress get up to %.0f s",
                        "each open connection closes after its response" if self.handing_over else
                        "new requests get 503", core.active, grace)
        deadline = time.monotonic() + grace
        while core.active and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        core.draining = True
        if core.active:
            logger.info("shutdown grace over: ending %d requests (streams with an error event and [DONE])",
                        core.cut())
            end = time.monotonic() + _CUT_S
            while core.active and time.monotonic() < end:
                await asyncio.sleep(0.01)
        await super().shutdown(sockets)

    def _hand_over_ports(self, grace: float) -> None:
        """A successor shares the ports (--reuse-port): stop listening now, so that every new connection reaches
        it. Requests on connections already open are still served here, each answered with `Connection: close`
        (CloseAfterResponse), so that a keep-alive client sends its next request to the successor and none is cut
        while it sends. The streams in progress finish here within the grace."""
        logger.info("handing the ports over: no longer listening; the open connections close after their response")
        self.gateway.handing_over = True
        for server in self.servers:
            server.close()
        if self.gateway.grpc_server is not None:  # no new RPCs; those in progress get the grace
            # (the task is kept: the loop holds only a weak reference to it)
            self._grpc_stop = asyncio.ensure_future(self.gateway.grpc_server.stop(grace=grace))


class CloseAfterResponse:
    """Once the gateway hands its ports over, every response says `Connection: close`."""

    def __init__(self, app, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message) -> None:
            if message["type"] == "http.response.start" and self.gateway.handing_over:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that another process may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def make_server(config: GatewayConfig, gateway: Gateway | None = None, log_level: str = "info") -> _Server:
    gateway = gateway or Gateway(config)
    app = build_app(gateway, config.grpc_port)
    # The drain happens before uvicorn's own shutdown (_Server.shutdown), which then only waits for responses
    # already ending.
    tls = config.serving_tls()
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(), lifespan="on",
                        timeout_graceful_shutdown=_CUT_S, access_log=config.log_requests, timeout_keep_alive=30,
                        **(tls.uvicorn_options() if tls is not None else {}))
    return _Server(uv, gateway)


def serve(config: GatewayConfig, log_level: str = "info") -> int:
    if ((config.api_key or config.api_keys_file) and config.serving_tls() is None
            and not is_loopback(config.host)):
        logger.warning("API keys over plain HTTP on %s: anyone on the path reads them; give --ssl-certfile and "
                       "--ssl-keyfile, or put a TLS proxy in front (docs/security.md)", config.host)
    logging.getLogger("kvrelay.access").setLevel(logging.INFO if config.log_requests else logging.WARNING)
    tracing.setup_tracing("kvrelay-gateway", config.otlp_traces_endpoint)
    try:
        # server.run() picks uvloop and httptools when installed (uvicorn[standard]): ~1 ms less per request.
        sockets = [reuse_port_socket(config.host, config.port)] if config.reuse_port else None
        make_server(config, log_level=log_level).run(sockets=sockets)
    finally:
        tracing.shutdown_tracing()
    return 0
