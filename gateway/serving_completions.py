"""POST /v1/completions: one or more prompts (text or token ids), n choices each.

Choice i of prompt p has index p * n + i, as in OpenAI's API. Every prompt is routed on its own.
`echo` with `logprobs` returns the prompt's tokens and their logprobs too (the first token's is null), from
the nodes' prompt logprobs; `prompt_logprobs` (vLLM) returns them in vLLM's shape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.responses import Response

from kvrelay.gateway import structured
from kvrelay.gateway.core import GatewayCore, GenerateInput, Generation, merge, new_request_id
from kvrelay.gateway.errors import BadRequest, GatewayError
from kvrelay.gateway.models import Target
from kvrelay.gateway.outputs import ChoiceOutput, Delta, LogprobEntry, TokenTexts
from kvrelay.gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    PromptTokensDetails,
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

logger = logging.getLogger(__name__)
MAX_PROMPTS = 64


class CompletionServing:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def create(self, req: CompletionRequest, target: Target, header_request_id: str | None = None) -> Response:
        """`target`: what req.model resolved to (gateway.models), this core's model or an adapter on it."""
        model = target.name
        request_id = header_request_id or req.request_id or new_request_id("cmpl")
        prompts = self._prompts(req)
        constraint = structured.from_request(req)
        inputs = [self._input(req, ids, f"{request_id}-p{i}", constraint, target.lora_name)
                  for i, ids in enumerate(prompts)]
        gens = [self.core.generate(inp) for inp in inputs]
        echo = [self._echo_text(req, p) for p in prompts]
        state = _State(gens, req.n or 1, echo, self.core.texts, req.logprobs if req.echo else None)
        headers = request_id_headers(header_request_id)
        if req.stream:
            return await _stream(state, request_id, model, req, headers)
        body = await _collect(state, request_id, model)
        return json_response(body, {**state.gens[0].route_headers(), **headers})

    # ------------------------------------------------------------------------------------- inputs

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        if req.suffix:
            raise BadRequest("suffix is not supported by this server", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1) and not req.use_beam_search:
            raise BadRequest("best_of must equal n when set (no server-side ranking without use_beam_search)",
                             param="best_of")
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.core.tokenizer.encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, str) for x in p):
            prompts = [self.core.tokenizer.encode(x) for x in p]
        else:
            prompts = [list(x) for x in p]
        if not prompts:
            raise BadRequest("the prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        for ids in prompts:
            self.core.check_prompt(ids, "prompt")
        return prompts

    def _input(self, req: CompletionRequest, prompt: list[int], request_id: str, constraint,
               lora_name: str = "") -> GenerateInput:
        max_tokens = self.core.fit_max_tokens(len(prompt), req.max_tokens, "prompt", "max_tokens")
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:  # echoed prompt tokens carry their logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        params = sampling_params(req, self.core, max_tokens=max_tokens, logprobs=req.logprobs,
                                 structured=constraint, prompt_logprobs=prompt_logprobs)
        beams = beam_search_params(req, max_tokens=max_tokens, best_of=req.best_of)
        return GenerateInput(prompt, params, output_options(req, req.logprobs), request_id=request_id,
                             cache_salt=req.cache_salt or "", user=req.user, beam_search=beams, lora_name=lora_name)

    def _echo_text(self, req: CompletionRequest, prompt: list[int]) -> str:
        if not req.echo:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        return self.core.tokenizer.decode(prompt, skip_special_tokens=False)


class _State:
    """All prompts' generations, and each choice's logprobs and text offsets so far.
    `echo_logprobs`: echo with logprobs asked (top k per echoed prompt token)."""

    def __init__(self, gens: list[Generation], n: int, echo: list[str], texts: TokenTexts,
                 echo_logprobs: int | None = None) -> None:
        self.gens, self.n, self.echo, self.texts = gens, n, echo, texts
        self.echo_logprobs = echo_logprobs
        self.offsets: dict[int, int] = {}
        self.logprobs: dict[int, CompletionLogprobs] = {}

    def index(self, prompt_index: int, delta: Delta) -> int:
        return prompt_index * self.n + delta.index

    def choice(self, index: int) -> tuple[int, ChoiceOutput]:
        p, i = divmod(index, self.n)
        return p, self.gens[p].choices[i]

    def prompt_logprobs(self, index: int):
        p, choice = self.choice(index)
        if self.gens[p].inp.params.prompt_logprobs is None:
            return None
        return prompt_logprobs_view(choice.prompt_logprobs, self.gens[p].inp.prompt_token_ids, self.texts)

    def logprobs_of(self, index: int, entries: list[LogprobEntry], first: bool = False) -> CompletionLogprobs:
        out = CompletionLogprobs()
        if first and self.echo_logprobs is not None:
            self._echoed(index, out)
        offset = self.offsets.get(index, len(self.echo[index // self.n]))
        for e in entries:
            out.tokens.append(e.token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({t: v for _, t, v in e.top})
            out.text_offset.append(offset)
            offset += len(e.token)
        self.offsets[index] = offset
        return out

    def _echoed(self, index: int, out: CompletionLogprobs) -> None:
        """The prompt's tokens first: their logprobs given what precedes them (none for the first)."""
        p, choice = self.choice(index)
        plp = choice.prompt_logprobs or ()
        offset, k = 0, self.echo_logprobs or 0
        for i, token in enumerate(self.gens[p].inp.prompt_token_ids):
            entry = plp[i] if i < len(plp) else None
            text = self.texts.get(token)
            out.tokens.append(text)
            out.text_offset.append(offset)
            out.token_logprobs.append(None if entry is None else entry.logprob)
            out.top_logprobs.append(None if entry is None else {self.texts.get(t): v for t, v in entry.top[:k]})
            offset += len(text)

    def usage(self) -> UsageInfo:
        us = [g.usage for g in self.gens]
        prompt, completion = sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in us)))

    def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        streams = [_tagged(i, g) for i, g in enumerate(self.gens)]
        return streams[0] if len(streams) == 1 else merge(streams)


async def _tagged(prompt_index: int, gen: Generation) -> AsyncIterator[tuple[int, Delta]]:
    async with aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            yield prompt_index, delta


async def _collect(state: _State, request_id: str, model: str) -> CompletionResponse:
    want = state.gens[0].inp.options.logprobs is not None
    entries: dict[int, list[LogprobEntry]] = {}
    async with aclosing(state.deltas()) as deltas:
        async for p, delta in deltas:
            entries.setdefault(state.index(p, delta), []).extend(delta.logprobs)
    choices = []
    for p, gen in enumerate(state.gens):
        for c in gen.choices:
            i = p * state.n + c.index
            lps = state.logprobs_of(i, entries.get(i, []), first=True) if want else None
            choices.append(CompletionChoice(index=i, text=state.echo[p] + c.text, logprobs=lps,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=state.prompt_logprobs(i)))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=state.usage())


async def _stream(state: _State, request_id: str, model: str, req: CompletionRequest,
                  headers: dict[str, str]) -> SSEResponse:
    deltas = state.deltas()
    try:
        first = await anext(deltas, None)
    except BaseException:
        await deltas.aclose()
        raise
    opts = req.stream_options
    body = _events(state, deltas, first, request_id, model, bool(opts and opts.include_usage),
                   bool(opts and opts.continuous_usage_stats))
    return SSEResponse(body, on_close=deltas.aclose, headers={**state.gens[0].route_headers(), **headers},
                       cut_error=state.gens[0].core.cut_error)


async def _events(state: _State, deltas, first, request_id: str, model: str, include_usage: bool,
                  continuous: bool) -> AsyncIterator[str]:
    want = state.gens[0].inp.options.logprobs is not None
    echoed: set[int] = set()
    try:
        item = first
        while item is not None:
            p, delta = item
            i = state.index(p, delta)
            text, first = delta.text, i not in echoed
            if first:
                echoed.add(i)
                text = state.echo[p] + text
            choice = CompletionChoice(index=i, text=text, finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason,
                                      logprobs=state.logprobs_of(i, delta.logprobs, first) if want else None,
                                      prompt_logprobs=state.prompt_logprobs(i) if first else None)
            yield sse(CompletionStreamResponse(id=request_id, model=model, choices=[choice],
                                               usage=state.usage() if continuous else None))
            item = await anext(deltas, None)
    except GatewayError as e:
        logger.warning("stream %s ended by an error: %s", request_id, e.message)
        yield sse_error(e)
    except Exception:  # headers are out: the client can only learn of it in the stream
        logger.exception("stream %s failed", request_id)
        yield sse_error(GatewayError("internal error while streaming"))
    finally:
        await deltas.aclose()
    if include_usage:
        yield sse(CompletionStreamResponse(id=request_id, model=model, choices=[], usage=state.usage()))
    yield SSE_DONE
