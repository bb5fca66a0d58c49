"""POST /v1/chat/completions: messages -> the model's chat template -> token ids -> routed generation."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.responses import Response

from gateway.core import GatewayCore, GenerateInput, Generation, new_request_id
from gateway.errors import BadRequest, GatewayError
from gateway.outputs import Delta, LogprobEntry
from gateway.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprobEntry,
    UsageInfo,
)
from gateway.serving_common import (
    SSE_DONE,
    SSEResponse,
    beam_search_params,
    check_model,
    check_unsupported,
    json_response,
    output_options,
    sampling_params,
    sse,
    sse_error,
)

logger = logging.getLogger(__name__)


class ChatServing:
    def __init__(self, core: GatewayCore, served_names: list[str]) -> None:
        self.core = core
        self.served_names = served_names

    async def create(self, req: ChatCompletionRequest) -> Response:
        model = check_model(req.model, self.served_names)
        gen = self.core.generate(self._input(req))
        request_id = gen.request_id
        if req.stream:
            return await _stream(gen, request_id, model, req)
        return json_response(await _collect(gen, request_id, model), gen.route_headers())

    def _input(self, req: ChatCompletionRequest) -> GenerateInput:
        check_unsupported(req)
        if req.response_format is not None and req.response_format.type != "text":
            raise BadRequest(f"response_format {req.response_format.type!r} is not supported", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = self._render(req)
        self.core.check_prompt(prompt, "messages")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.core.fit_max_tokens(len(prompt), asked, "messages", param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, self.core, max_tokens=max_tokens, logprobs=logprobs)
        return GenerateInput(prompt, params, output_options(req, logprobs),
                             request_id=req.request_id or new_request_id("chatcmpl"), cache_salt=req.cache_salt or "",
                             beam_search=beam_search_params(req, max_tokens=max_tokens))

    def _render(self, req: ChatCompletionRequest) -> list[int]:
        messages = [_message_dict(m) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        if req.continue_final_message:
            if req.messages[-1].role != "assistant":
                raise BadRequest("continue_final_message needs an assistant message last", param="messages")
            kwargs["continue_final_message"] = True
        add_prompt = req.add_generation_prompt and not req.continue_final_message
        try:
            return self.core.tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, **kwargs)
        except Exception as e:  # a template rejecting the conversation (e.g. roles out of order) is bad input
            raise BadRequest(f"the chat template could not render these messages: {e}", param="messages") from None


def _message_dict(m) -> dict:
    content = m.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out: dict = {"role": m.role, "content": content if content is not None else ""}
    for key in ("name", "tool_call_id", "tool_calls"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


def _logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    def top(e: LogprobEntry) -> list[TopLogprobEntry]:
        return [TopLogprobEntry(token=t, logprob=v, bytes=list(t.encode())) for _, t, v in e.top]

    return ChatLogprobs(content=[
        ChatLogprobEntry(token=e.token, logprob=e.logprob, bytes=list(e.token.encode()), top_logprobs=top(e))
        for e in entries
    ])


def _usage(gen: Generation) -> UsageInfo:
    u = gen.usage
    return UsageInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))


async def _collect(gen: Generation, request_id: str, model: str) -> ChatCompletionResponse:
    want_logprobs = gen.inp.options.logprobs is not None
    entries: dict[int, list[LogprobEntry]] = {c.index: [] for c in gen.choices}
    async with aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            entries[delta.index].extend(delta.logprobs)
    choices = [
        ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                   logprobs=_logprobs(entries[c.index]) if want_logprobs else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in gen.choices
    ]
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(gen))


async def _stream(gen: Generation, request_id: str, model: str, req: ChatCompletionRequest) -> SSEResponse:
    deltas = gen.deltas()
    try:
        first = await anext(deltas, None)  # routing and node errors still become HTTP errors here
    except BaseException:
        await deltas.aclose()
        raise
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    body = _events(gen, deltas, first, request_id, model, include_usage, continuous)
    return SSEResponse(body, on_close=deltas.aclose, headers=gen.route_headers())


async def _events(gen: Generation, deltas: AsyncIterator[Delta], first: Delta | None, request_id: str, model: str,
                  include_usage: bool, continuous: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, usage=usage))

    # The role chunks go out with the first content, in one write.
    pending = "".join(chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                      for c in gen.choices)
    try:
        delta = first
        while delta is not None:
            choice = ChatStreamChoice(
                index=delta.index, delta=DeltaMessage(content=delta.text),
                logprobs=_logprobs(delta.logprobs) if delta.logprobs else None,
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
            yield pending + chunk([choice], _usage(gen) if continuous else None)
            pending = ""
            delta = await anext(deltas, None)
    except GatewayError as e:
        logger.warning("stream %s ended by an error: %s", request_id, e.message)
        yield sse_error(e)
    except Exception:  # headers are out: the client can only learn of it in the stream
        logger.exception("stream %s failed", request_id)
        yield sse_error(GatewayError("internal error while streaming"))
    finally:
        await deltas.aclose()
    if include_usage:
        pending += chunk([], _usage(gen))
    yield pending + SSE_DONE
