"""The gateway's gRPC API (kvrelay.gateway.v1.Gateway): the same generation and routing as the HTTP API.

The request is turned into the attribute names of the OpenAI request models, so validation, sampling
params and stop handling are literally the HTTP path's (serving_common). A cancelled call cancels the
handler, which aborts its sequences on the nodes.

Keys are the HTTP API's (gateway.auth), sent as 'authorization: Bearer <key>' metadata: UNAUTHENTICATED without
a valid one, PERMISSION_DENIED for a model the key may not use; a generation takes from the key's rate limits
(RESOURCE_EXHAUSTED past them, with the x-ratelimit-* values and retry-after as trailing metadata). Requests are
parsed here, not by gRPC, so a message that is not a valid GenerateRequest is INVALID_ARGUMENT with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from types import SimpleNamespace

import grpc
from google.protobuf.message import DecodeError

from kvrelay.common.tracing import incoming_traceparent
from kvrelay.gateway.auth import check_model, current_principal
from kvrelay.gateway.core import GenerateInput, Generation, new_request_id
from kvrelay.gateway.errors import BadRequest, GatewayError
from kvrelay.gateway.outputs import Delta, LogprobEntry
from kvrelay.gateway.ratelimit import current_rate
from kvrelay.gateway.serving_common import observe_error, output_options, sampling_params
from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2 as pb
from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           502: grpc.StatusCode.UNAVAILABLE, 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "max_tokens", "logprobs", "skip_special_tokens")


def _fields(msg: pb.GenerateRequest) -> SimpleNamespace:
    """The proto's sampling fields under the OpenAI request models' names (unset optionals are None)."""
    p = msg.params
    values = {name: getattr(p, name) if p.HasField(name) else None for name in _OPTIONAL}
    values["skip_special_tokens"] = True if values["skip_special_tokens"] is None else values["skip_special_tokens"]
    return SimpleNamespace(
        **values, min_tokens=p.min_tokens, stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        priority=p.priority, stop=list(p.stop), include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=None,
    )


def _with_images(m: pb.ChatMessage, placeholder: str | None) -> str:
    """A message's content as the template takes it: its images' placeholders first, one line each."""
    return "".join(f"{placeholder}\n" for _ in m.images) + m.content if placeholder else m.content


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, gateway) -> None:
        self.gateway = gateway
        self.core = gateway.core

    async def ListModels(self, raw: bytes, context):
        await _parse(pb.ModelsRequest, raw, context)
        try:
            principal = self._auth(context)
        except GatewayError as e:
            await self._abort(context, e)
        names = [*self.gateway.served_names, *(a.name for a in self.gateway.adapters.served())]
        return pb.ModelsResponse(models=[n for n in names if principal.may_use(n)],
                                 max_model_len=self.core.max_model_len)

    async def Generate(self, raw: bytes, context) -> AsyncIterator[pb.GenerateResponse]:
        request = await _parse(pb.GenerateRequest, raw, context)
        try:
            principal = self._auth(context)
            target = self.gateway.models.resolve(request.model or None)
            check_model(principal, target.name)
            current_rate.set(await self.gateway.limiter.admit(principal))
            model = target.name
            gen = target.endpoint.core.generate(await self._input(request, target))
        except GatewayError as e:
            await self._abort(context, e)
        try:
            async for msg in self._responses(gen, model, request.stream):
                yield msg
            self.gateway.metrics.observe_request("success")
        except GatewayError as e:
            await self._abort(context, e)

    async def Embed(self, raw: bytes, context) -> pb.EmbedResponse:  # noqa: N802 - gRPC method names
        request = await _parse(pb.EmbedRequest, raw, context)
        try:
            principal = self._auth(context)
            target = self.gateway.models.resolve(request.model or None)
            check_model(principal, target.name)
            current_rate.set(await self.gateway.limiter.admit(principal))
            serving = target.endpoint.embeddings
            if request.texts and request.token_ids:
                raise BadRequest("give texts or token_ids, not both", param="texts")
            inputs = serving.encode(list(request.texts) or [list(t.ids) for t in request.token_ids], "texts")
            pooling = serving.embedding_params(request.normalize if request.HasField("normalize") else True,
                                               request.dimensions if request.HasField("dimensions") else None,
                                               target.name)
            vectors = await serving.vectors(inputs, target, request.request_id or new_request_id("embd"), pooling)
        except GatewayError as e:
            await self._abort(context, e)
        self.gateway.metrics.observe_request("success")
        tokens = sum(len(ids) for ids in inputs)
        return pb.EmbedResponse(model=target.name, embeddings=[pb.Embedding(values=v) for v in vectors],
                                usage=pb.Usage(prompt_tokens=tokens))

    def _auth(self, context):
        """The caller's principal (gateway.auth), also as `current_principal` for this call."""
        meta = dict(context.invocation_metadata() or ())
        principal = self.gateway.keys.authenticate(meta.get("authorization"))
        current_principal.set(principal)
        if meta.get("traceparent"):
            incoming_traceparent.set(str(meta["traceparent"])[:64])
        return principal

    async def _abort(self, context, e: GatewayError) -> None:
        observe_error(self.gateway.metrics, e)
        trailers = tuple((k.lower(), v) for k, v in e.headers().items())
        if trailers:
            context.set_trailing_metadata(trailers)
        await context.abort(_STATUS.get(int(e.status), grpc.StatusCode.INTERNAL), e.message)

    async def _input(self, msg: pb.GenerateRequest, target) -> GenerateInput:
        core, images = target.endpoint.core, target.endpoint.images
        fields = _fields(msg)
        prompt = self._prompt(msg, core.tokenizer, images.placeholder)
        datas = await images.check([(f"chat.messages[{i}].images[{j}]", bytes(data))
                                    for i, m in enumerate(msg.chat.messages) for j, data in enumerate(m.images)],
                                   "chat.messages") if msg.WhichOneof("input") == "chat" else []
        prompt, found = images.expand(prompt, datas)
        core.check_prompt(prompt, "prompt")
        max_tokens = core.fit_max_tokens(len(prompt), fields.max_tokens, "prompt", "max_tokens")
        params = sampling_params(fields, core, max_tokens=max_tokens, logprobs=fields.logprobs)
        return GenerateInput(prompt, params, output_options(fields, fields.logprobs),
                             request_id=msg.request_id or new_request_id("grpc"), cache_salt=msg.cache_salt,
                             lora_name=target.lora_name, images=found)

    def _prompt(self, msg: pb.GenerateRequest, tok, placeholder: str | None) -> list[int]:
        kind = msg.WhichOneof("input")
        if kind == "prompt":
            return tok.encode(msg.prompt)
        if kind == "prompt_token_ids":
            return list(msg.prompt_token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": _with_images(m, placeholder),
                         **({"name": m.name} if m.name else {})} for m in msg.chat.messages]
            add = msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True
            try:
                return tok.apply_chat_template(messages, add_generation_prompt=add)
            except Exception as e:  # the template rejecting the conversation is the caller's input
                raise BadRequest(f"the chat template could not render these messages: {e}", param="chat") from None
        raise BadRequest("one of prompt, prompt_token_ids or chat is required", param="input")

    async def _responses(self, gen: Generation, model: str, stream: bool) -> AsyncIterator[pb.GenerateResponse]:
        rid = gen.request_id
        async with aclosing(gen.deltas()) as deltas:
            if stream:
                async for delta in deltas:
                    yield pb.GenerateResponse(request_id=rid, model=model, choices=[_delta(delta)])
            else:
                merged = {c.index: Delta(c.index) for c in gen.choices}
                async for delta in deltas:
                    _accumulate(merged[delta.index], delta)
        u = gen.usage
        usage = pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         cached_tokens=u.cached_tokens)
        choices = [] if stream else [_delta(merged[i]) for i in sorted(merged)]
        yield pb.GenerateResponse(request_id=rid, model=model, choices=choices, usage=usage, finished=True)


def _accumulate(into: Delta, delta: Delta) -> None:
    into.text += delta.text
    into.token_ids.extend(delta.token_ids)
    into.logprobs.extend(delta.logprobs)
    if delta.finish_reason:
        into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason


def _delta(d: Delta) -> pb.ChoiceDelta:
    msg = pb.ChoiceDelta(index=d.index, text=d.text, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
                         logprobs=[_logprob(e) for e in d.logprobs])
    if isinstance(d.stop_reason, str):
        msg.stop_string = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_token_id = d.stop_reason
    return msg


def _logprob(e: LogprobEntry) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in e.top]
    return pb.TokenLogprob(token_id=e.token_id, token=e.token, logprob=e.logprob, top=top)


async def _parse(cls, raw: bytes, context):
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError) as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a valid {cls.DESCRIPTOR.name}: {e}")


def _identity(raw: bytes) -> bytes:
    return raw


def _handlers(servicer: GatewayServicer) -> grpc.GenericRpcHandler:
    """The service's methods, taking their requests as bytes (parsed by the servicer: see the module's doc)."""
    methods = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_identity,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_identity,
            response_serializer=pb.ModelsResponse.SerializeToString),
        "Embed": grpc.unary_unary_rpc_method_handler(
            servicer.Embed, request_deserializer=_identity, response_serializer=pb.EmbedResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler("kvrelay.gateway.v1.Gateway", methods)


async def start_grpc_server(gateway, host: str, port: int) -> grpc.aio.Server:
    # SO_REUSEPORT only with --reuse-port: a successor shares the port during a rolling restart.
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(gateway.config.reuse_port)),
                                      ("grpc.max_receive_message_length", gateway.config.max_body_bytes or -1)])
    server.add_generic_rpc_handlers((_handlers(GatewayServicer(gateway)),))
    tls = gateway.config.serving_tls()
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, tls.grpc_server_credentials()) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot bind the gRPC API to {host}:{port}")
    await server.start()
    gateway.grpc_port, gateway.grpc_server = bound, server
    logger.info("gateway gRPC API on %s:%d%s", host, bound, " (TLS)" if tls is not None else "")
    return server
