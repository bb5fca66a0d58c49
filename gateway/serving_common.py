"""What chat and completions share: sampling params, output options, SSE framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from kvrelay.common.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputs
from kvrelay.gateway.errors import BadRequest, GatewayError, ShuttingDown
from kvrelay.gateway.outputs import OutputOptions
from kvrelay.gateway.protocol import PromptLogprob

SSE_DONE = "data: [DONE]\n\n"
_OUTCOME = {400: "client_error", 401: "unauthorized", 403: "unauthorized", 404: "not_found", 413: "client_error",
            429: "overloaded", 503: "no_capacity", 502: "node_error", 504: "timeout"}
# 429s whose own code says why (a key's limits, fairness) count under it, not as plain overload.
_REJECTED = ("rate_limit_exceeded", "concurrency_limit", "shed", "tenant_share")


def observe_error(metrics, exc: GatewayError) -> None:
    """Count a request that ended in an error response (its outcome; a refusal at admission by reason)."""
    status = int(exc.status)
    metrics.observe_request(_OUTCOME.get(status, "client_error"))
    if status in (429, 503):
        reason = ("draining" if isinstance(exc, ShuttingDown) else exc.code if exc.code in _REJECTED
                  else "overloaded" if status == 429 else "no_capacity")
        metrics.rejected.labels(reason).inc()


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    return tuple(s for s in dict.fromkeys(items) if s)  # an empty stop string would end every request at once


def logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as engine pairs; 400 for a key that is not a token id of the vocabulary."""
    out = []
    for key, bias in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                             param="logit_bias")
        out.append((token, bias))
    return tuple(out)


def sampling_params(req, core, *, max_tokens: int, logprobs: int | None,
                    structured: StructuredOutputs | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling fields as engine params; a bad value is a 400 naming the field."""
    bias = logit_bias(getattr(req, "logit_bias", None), core.vocab_size)
    try:
        return SamplingParams(
            n=req.n if req.n is not None else 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop_token_ids=core.engine_stop_ids(req.stop_token_ids or (), req.ignore_eos),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            priority=req.priority,
            structured_outputs=structured,
            logit_bias=bias,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise BadRequest.from_value_error(e) from None


def beam_search_params(req, *, max_tokens: int, best_of: int | None = None) -> BeamSearchParams | None:
    """use_beam_search as vLLM takes it: best_of (else n) beams, the n best returned; None when not asked."""
    if not req.use_beam_search:
        return None
    if req.temperature not in (None, 0.0):
        raise BadRequest("beam search is deterministic: temperature must be 0 or unset", param="temperature")
    logprobs = getattr(req, "logprobs", None)
    if logprobs is not None and logprobs is not False:
        raise BadRequest("logprobs are not supported with use_beam_search", param="logprobs")
    n = req.n if req.n is not None else 1
    width = best_of if best_of is not None else n
    if width < n:
        raise BadRequest(f"best_of ({width}) must be at least n ({n}) with use_beam_search", param="best_of")
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=req.length_penalty,
                                ignore_eos=req.ignore_eos, early_stopping=req.early_stopping)
    except ValueError as e:
        raise BadRequest.from_value_error(e) from None


def output_options(req, logprobs: int | None) -> OutputOptions:
    return OutputOptions(stop=stop_strings(req.stop), include_stop_str_in_output=req.include_stop_str_in_output,
                         skip_special_tokens=req.skip_special_tokens, logprobs=logprobs)


def request_id_headers(header_request_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": header_request_id} if header_request_id else {}


def prompt_logprobs_view(plp, prompt_ids, texts) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for the prompt's
    own token and the top k; None for the first token (nothing precedes it)."""
    if plp is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in plp:
        if entry is None:
            out.append(None)
            continue
        view = {str(entry.token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                   decoded_token=texts.get(entry.token_id))}
        for rank, (token, lp) in enumerate(entry.top, start=1):
            view.setdefault(str(token), PromptLogprob(logprob=lp, rank=rank, decoded_token=texts.get(token)))
        out.append(view)
    return out


def json_response(model: BaseModel, headers: dict[str, str]) -> Response:
    return Response(model.model_dump_json(exclude_none=True), media_type="application/json", headers=headers)


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


def sse_error(err: GatewayError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that stops as soon as the client hangs up, and always closes its upstream generation,
    even when the body never started: that is what aborts the sequences on the nodes.

    Leaner than Starlette's: the disconnect watcher cancels this task directly (no task group per stream),
    which keeps the first event a fraction of a millisecond closer to the first token.

    A shutdown that cuts the stream (GatewayCore.cut) usually lands in the body, which then ends with the error
    event and [DONE] itself; `cut_error` covers one that lands while an event is being written: the stream then
    ends with that error event and [DONE] here."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None,
                 cut_error: Callable[[], GatewayError | None] = lambda: None) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close
        self._cut_error = cut_error

    def detach(self) -> tuple[AsyncIterator[str], Callable[[], Awaitable[None]], Callable[[], GatewayError | None]]:
        """Its events, the close that aborts its generation, and its shutdown check, for a caller that serves
        them some other way (gateway.resumable records them for reconnecting clients)."""
        return self.body_iterator, self._on_close, self._cut_error

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            cut = None if gone.is_set() else self._cut_error()
            if not gone.is_set() and cut is None:
                raise
            task.uncancel()  # the client left (we cancelled ourselves), or a shutdown cut the stream
            if cut is not None:
                await self._end_with(send, cut)
        except OSError:
            pass  # the client left while we were writing
        finally:
            watcher.cancel()
            await self._on_close()

    async def _end_with(self, send, err: GatewayError) -> None:
        await self.body_iterator.aclose()
        try:
            body = (sse_error(err) + SSE_DONE).encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass
