"""POST /v1/chat/completions: messages -> the model's chat template -> token ids -> routed generation.

Output constraints (response_format, structured_outputs, guided_*) and forced tool choices become one
grammar in the sampling params (gateway.structured, gateway.tools). With tools, each choice's text goes
through a tool parser: whole for a response, delta by delta for a stream (content, then each call's id and
name, then its arguments in pieces, by index). Images in messages (a vision-language model) go through
gateway.images: fetched and checked first, rendered as the model's placeholder, widened to their positions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from starlette.responses import Response

from kvrelay.common.records import ImageInput
from kvrelay.gateway import structured, tools
from kvrelay.gateway.core import GatewayCore, GenerateInput, Generation, new_request_id
from kvrelay.gateway.errors import BadRequest, GatewayError
from kvrelay.gateway.images import ChatImages, image_urls
from kvrelay.gateway.models import Target
from kvrelay.gateway.outputs import ChoiceOutput, Delta, LogprobEntry
from kvrelay.gateway.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    TopLogprobEntry,
    UsageInfo,
)
from kvrelay.gateway.serving_common import (
    SSE_DONE,
    SSEResponse,
    beam_search_params,
    json_response,
    output_options,
    prompt_logprobs_view,
    request_id_headers,
    sampling_params,
    sse,
    sse_error,
)
from kvrelay.gateway.tool_parsers import StreamDelta, ToolParser

logger = logging.getLogger(__name__)


class ChatServing:
    """`tool_parser`: how tool_choice "auto" reads the model's calls (None: auto answers with content)."""

    def __init__(self, core: GatewayCore, tool_parser: ToolParser | None = None,
                 images: ChatImages | None = None) -> None:
        self.core = core
        self.tool_parser = tool_parser
        self.images = images

    async def create(self, req: ChatCompletionRequest, target: Target,
                     header_request_id: str | None = None) -> Response:
        """`target`: what req.model resolved to (gateway.models), this core's model or an adapter on it."""
        model = target.name
        plan = tools.plan(req, self.tool_parser)
        datas = await self.images.load(req.messages) if self.images is not None else []
        gen = self.core.generate(self._input(req, plan, header_request_id, target.lora_name, datas))
        request_id = gen.request_id
        headers = request_id_headers(header_request_id)
        if req.stream:
            return await _stream(gen, request_id, model, req, plan, headers)
        body = await _collect(gen, request_id, model, plan)
        return json_response(body, {**gen.route_headers(), **headers})

    def _input(self, req: ChatCompletionRequest, plan: tools.ToolPlan, header_id: str | None,
               lora_name: str = "", datas: list[bytes] | None = None) -> GenerateInput:
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        constraint = structured.from_request(req)
        if constraint is not None and plan.forced:
            raise BadRequest("a forced tool_choice already constrains the output; drop response_format / "
                             "structured_outputs", param="tool_choice")
        prompt, images = self._render(req, plan, datas or [])
        if images and req.use_beam_search:
            raise BadRequest("use_beam_search: not with images", param="use_beam_search")
        self.core.check_prompt(prompt, "messages")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.core.fit_max_tokens(len(prompt), asked, "messages", param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, self.core, max_tokens=max_tokens, logprobs=logprobs,
                                 structured=constraint or plan.grammar, prompt_logprobs=req.prompt_logprobs)
        options = output_options(req, logprobs)
        if plan.parser is not None and not plan.parser.skip_special_tokens:
            options = replace(options, skip_special_tokens=False)  # the format's markers are special tokens
        return GenerateInput(prompt, params, options,
                             request_id=header_id or req.request_id or new_request_id("chatcmpl"),
                             cache_salt=req.cache_salt or "", user=req.user,
                             beam_search=beam_search_params(req, max_tokens=max_tokens), lora_name=lora_name,
                             images=images)

    def render_for_tokenize(self, req) -> list[int]:
        """/tokenize with messages: the same rendering as a chat completion (tools offered as here; each image's
        placeholder widened to its positions, the image itself not fetched)."""
        count = len(image_urls(req.messages))
        return self._render(req, tools.plan(req, self.tool_parser), [b""] * count)[0]

    def _render(self, req: ChatCompletionRequest, plan: tools.ToolPlan,
                datas: list[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids and its images at their positions."""
        if datas and (self.images is None or self.images.placeholder is None):
            raise BadRequest("messages: this model takes no images", param="messages")
        placeholder = self.images.placeholder if self.images is not None else None
        template = getattr(self.core.tokenizer.hf, "chat_template", None) or ""
        if not isinstance(template, str):
            template = json.dumps(template)
        messages = tools.template_messages([_message_dict(m, placeholder) for m in req.messages], template,
                                           plan.parser or self.tool_parser)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            offer = plan.parser or self.tool_parser
            if "tools" not in template and req.tool_choice != "none" and offer is not None:
                # This template cannot show tools: offer them in a system message in the parser's format.
                messages = _with_system(messages, tools.tools_instruction(req.tools, offer))
        if req.continue_final_message:
            if req.messages[-1].role != "assistant":
                raise BadRequest("continue_final_message needs an assistant message last", param="messages")
            kwargs["continue_final_message"] = True
        add_prompt = req.add_generation_prompt and not req.continue_final_message
        try:
            tokens = self.core.tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, **kwargs)
        except Exception as e:  # a template rejecting the conversation (e.g. roles out of order) is bad input
            raise BadRequest(f"the chat template could not render these messages: {e}", param="messages") from None
        return self.images.expand(tokens, datas) if self.images is not None else (tokens, ())


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".strip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _message_dict(m, image_placeholder: str | None = None) -> dict:
    """A message as the chat template takes it: parts joined by newlines, an image as its placeholder text."""
    content = m.content
    if isinstance(content, list):
        content = "\n".join(part.text if part.type == "text" else image_placeholder or "" for part in content)
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


async def _collect(gen: Generation, request_id: str, model: str, plan: tools.ToolPlan) -> ChatCompletionResponse:
    want_logprobs = gen.inp.options.logprobs is not None
    entries: dict[int, list[LogprobEntry]] = {c.index: [] for c in gen.choices}
    async with aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            entries[delta.index].extend(delta.logprobs)
    choices = []
    for c in gen.choices:
        message = _message(c, plan)
        choices.append(ChatChoice(index=c.index, message=message,
                                  logprobs=_logprobs(entries[c.index]) if want_logprobs else None,
                                  finish_reason=_finish_reason(c.finish_reason, plan, bool(message.tool_calls)),
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(gen),
                                  prompt_logprobs=_prompt_logprobs(gen))


def _message(choice: ChoiceOutput, plan: tools.ToolPlan) -> ChatResponseMessage:
    if plan.parser is None:
        return ChatResponseMessage(content=choice.text)
    parsed = plan.parser.parse(choice.text)
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    if not calls:
        return ChatResponseMessage(content=choice.text or None if plan.forced else choice.text)
    return ChatResponseMessage(content=parsed.content, tool_calls=[
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])


def _finish_reason(reason: str | None, plan: tools.ToolPlan, called: bool) -> str | None:
    return plan.finish_reason if called and reason == "stop" and plan.finish_reason else reason


def _prompt_logprobs(gen: Generation):
    if gen.inp.params.prompt_logprobs is None:
        return None
    return prompt_logprobs_view(gen.choices[0].prompt_logprobs, gen.inp.prompt_token_ids, gen.core.texts)


async def _stream(gen: Generation, request_id: str, model: str, req: ChatCompletionRequest, plan: tools.ToolPlan,
                  headers: dict[str, str]) -> SSEResponse:
    deltas = gen.deltas()
    try:
        first = await anext(deltas, None)  # routing and node errors still become HTTP errors here
    except BaseException:
        await deltas.aclose()
        raise
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    body = _events(gen, deltas, first, request_id, model, include_usage, continuous, plan)
    return SSEResponse(body, on_close=deltas.aclose, headers={**gen.route_headers(), **headers},
                       cut_error=gen.core.cut_error)


class _ToolDeltas:
    """Per choice: the tool parser's stream, and each delta's text turned into content and call deltas."""

    def __init__(self, gen: Generation, plan: tools.ToolPlan) -> None:
        self.plan = plan
        self.streams = {c.index: plan.parser.stream() for c in gen.choices} if plan.parser else {}

    def message(self, delta: Delta) -> tuple[DeltaMessage, str | None]:
        stream = self.streams.get(delta.index)
        if stream is None:
            return DeltaMessage(content=delta.text), delta.finish_reason
        out: StreamDelta = stream.feed(delta.text, final=delta.finish_reason is not None)
        calls = [c for c in out.calls if self.plan.parallel or c.index == 0]
        tool_calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls] or None
        content = out.content or (None if tool_calls else "")
        return DeltaMessage(content=content, tool_calls=tool_calls), _finish_reason(
            delta.finish_reason, self.plan, stream.called)


async def _events(gen: Generation, deltas: AsyncIterator[Delta], first: Delta | None, request_id: str, model: str,
                  include_usage: bool, continuous: bool, plan: tools.ToolPlan) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None, prompt_logprobs=None) -> str:
        return sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, usage=usage,
                                                prompt_logprobs=prompt_logprobs))

    parsing = _ToolDeltas(gen, plan)

    # The role chunks go out with the first content, in one write.
    pending = "".join(chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
                      for c in gen.choices)
    try:
        delta = first
        plp = _prompt_logprobs(gen)
        while delta is not None:
            message, finish_reason = parsing.message(delta)
            choice = ChatStreamChoice(
                index=delta.index, delta=message, logprobs=_logprobs(delta.logprobs) if delta.logprobs else None,
                finish_reason=finish_reason, stop_reason=delta.stop_reason)
            if message.content is not None or message.tool_calls or finish_reason or delta.logprobs:
                yield pending + chunk([choice], _usage(gen) if continuous else None, plp)
                pending, plp = "", None
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
