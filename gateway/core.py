"""The text-level generate both APIs (OpenAI HTTP and gRPC) share: route once, fan out n choices, turn
engine tokens into per-choice text deltas, keep request metrics.

n > 1 runs n engine sequences on the nodes routing chose, each with its own seed stream
(SamplingParams.for_child); they share the prompt's blocks through the nodes' prefix caches.
Beam search runs as one engine request on the routed decode node (it prefills the prompt itself: the beams
fork its KV there); its last chunk carries the beams, the n best of which become the choices.

Several models: each base model has a GatewayCore of its own (its tokenizer, router, dispatcher); admission and
shutdown are the gateway's, shared by all of them through one `Activity`. A request for a LoRA adapter carries the
adapter's name to routing and to every node call.

Admission (gateway.admission): the bound on generations in progress, a key's own bound, fairness across tenants,
and each tenant request's place in the nodes' queues; each generation may have a deadline (`request_timeout_s`)
that every node call of its sequences obeys. Each tenant's prompts are salted with its name
(`tenant_cache_isolation`), so tenants never share, or time, each other's cached KV blocks. When a generation
ends, what it used (prompt + completion tokens) goes to `usage_sink` (the key's tokens per minute).

Shutdown: `draining` refuses new generations (503, Retry-After); once the drain's grace is over, `cut()` cancels
the tasks still running one. Each ends as a shutdown, not a failure: a stream with a final error event (OpenAI's
shape: ShuttingDown) and [DONE], a plain request with a 503; closing its node streams aborts its sequences.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from kvrelay.common import tracing
from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import BeamSearchParams, SamplingParams
from kvrelay.common.tokenizer import Tokenizer
from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.admission import Activity, Admission
from kvrelay.gateway.auth import DEFAULT_TENANT, Principal, current_principal
from kvrelay.gateway.dispatch import Dispatcher
from kvrelay.gateway.errors import BadRequest, ShuttingDown
from kvrelay.gateway.handover import KeyedRun, RunRecord, keyed_run
from kvrelay.gateway.node_client import EngineRequest
from kvrelay.gateway.outputs import ChoiceOutput, Delta, OutputOptions, TokenTexts
from kvrelay.gateway.ratelimit import current_rate
from kvrelay.gateway.router import Router

logger = logging.getLogger(__name__)
access_log = logging.getLogger("kvrelay.access")  # one JSON line per generation (GatewayConfig.log_requests)

_DONE = object()


@dataclass(frozen=True)
class GenerateInput:
    prompt_token_ids: Sequence[int]
    params: SamplingParams  # params.n choices
    options: OutputOptions
    request_id: str = ""
    cache_salt: str = ""
    user: str | None = None  # the OpenAI `user` field: a session-affinity hint for routing
    beam_search: BeamSearchParams | None = None  # set: the choices are the n best of its beams
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    images: tuple[ImageInput, ...] = ()  # the prompt's images, at their placeholder tokens (content hashes set)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class GatewayCore:
    """One base model's generations. `activity`: shared with the gateway's other models (None: its own)."""

    def __init__(self, tokenizer: Tokenizer, router: Router, dispatcher: Dispatcher, metrics=None,
                 max_model_len: int | None = None, default_max_model_len: int = 2048,
                 admission: Admission | None = None, activity: Activity | None = None,
                 usage_sink: Callable[[Principal | None, int], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.usage_sink = usage_sink
        self.router = router
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.admission = admission or Admission()
        self.activity = activity or Activity()
        self.texts = TokenTexts(tokenizer)
        self._max_model_len = max_model_len
        self._default_max_model_len = default_max_model_len

    @property
    def draining(self) -> bool:
        return self.activity.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.activity.draining = value

    @property
    def active(self) -> int:
        return self.activity.active

    @property
    def was_cut(self) -> bool:
        return self.activity.was_cut

    def cut(self) -> int:
        return self.activity.cut()

    def in_progress(self, principal: Principal | None = None):
        return self.activity.in_progress(principal)

    @staticmethod
    def shutdown_error() -> ShuttingDown:
        """What a generation ended by cut() answers: a 503, or in a stream the final error event."""
        return ShuttingDown("the server is shutting down and its grace period for open requests is over; retry "
                            "on another replica or after it restarts")

    def cut_error(self) -> ShuttingDown | None:
        """shutdown_error() once cut() has run, else None."""
        return self.shutdown_error() if self.was_cut else None

    # ------------------------------------------------------------------------------------ limits

    @property
    def max_model_len(self) -> int:
        return self._max_model_len or self.router.discovery.max_model_len() or self._default_max_model_len

    @property
    def vocab_size(self) -> int:
        return self.router.discovery.vocab_size() or self.tokenizer.vocab_size

    def check_prompt(self, prompt_ids: Sequence[int], param: str) -> None:
        if not prompt_ids:
            raise BadRequest("the prompt is empty", param=param)
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    def fit_max_tokens(self, num_prompt: int, max_tokens: int | None, param: str, max_tokens_param: str) -> int:
        """The max_tokens the engines get: what was asked, or the room left; 400 when it cannot fit."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your prompt "
                             f"has {num_prompt} tokens, which leaves no room to generate.", param=param)
        if max_tokens is None:
            return limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.", param=max_tokens_param)
        return max_tokens

    def engine_stop_ids(self, stop_token_ids: Sequence[int], ignore_eos: bool) -> tuple[int, ...]:
        """The caller's stop ids, plus end tokens generation_config lists beyond the model's one eos."""
        ids = list(dict.fromkeys(int(t) for t in stop_token_ids))
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token ids {bad} are outside the vocabulary [0, {vocab})", param="stop_token_ids")
        if not ignore_eos:
            eos = self.tokenizer.eos_token_id
            ids += sorted(t for t in self.tokenizer.stop_token_ids if t != eos and t not in ids)
        return tuple(ids)

    # ---------------------------------------------------------------------------------- generate

    def generate(self, inp: GenerateInput) -> Generation:
        if self.draining:
            raise ShuttingDown("the gateway is shutting down; retry on another replica")
        principal = current_principal.get()
        self.activity.admit(self.admission, principal)
        if principal is not None and principal.tenant != DEFAULT_TENANT:
            inp = self._for_tenant(inp, principal)
        return Generation(self, inp, principal)

    def _for_tenant(self, inp: GenerateInput, principal: Principal) -> GenerateInput:
        """A tenant's request: its own KV blocks (the salt), and its place in the nodes' queues: after what other
        tenants sent since its own requests in flight and behind keys further from their rate limits, as a fair
        queue would put it (the nodes run lower priority values first; a key's band outranks everything, a
        request's own priority only adds)."""
        rate = current_rate.get()
        priority = self.activity.engine_priority(principal, inp.params.priority,
                                                 rate.pressure if rate is not None else 0.0)
        inp = replace(inp, params=replace(inp.params, priority=priority))
        if self.admission.tenant_cache_isolation:
            inp = replace(inp, cache_salt=f"{principal.tenant}\x00{inp.cache_salt}")
        return inp


class Generation:
    """One request's choices. Iterate `deltas()` once; `usage` and `choices` are complete afterwards."""

    def __init__(self, core: GatewayCore, inp: GenerateInput, principal: Principal | None = None) -> None:
        self.core = core
        self.inp = inp
        self.principal = principal
        n = inp.params.n
        run = keyed_run.get()  # a keyed request: handed over to another gateway should this one die
        self.run: KeyedRun | None = run if run is not None and n == 1 and inp.beam_search is None else None
        resumed = self.run.resume if self.run is not None else None
        self.request_id = resumed.request_id if resumed is not None else inp.request_id or new_request_id("req")
        self.choices = [ChoiceOutput(i, core.tokenizer, core.texts, inp.prompt_token_ids, inp.options)
                        for i in range(n)]
        self._start = time.perf_counter()
        timeout = core.admission.request_timeout_s
        self.deadline = time.monotonic() + timeout if timeout > 0 else None
        self._first: float | None = None
        self._last: dict[int, float] = {}
        self._itls: list[float] = []
        self.traces: list[dict] = [{} for _ in range(n)]  # per choice: the nodes that served it
        # Read here, in the request's own context: the client's trace, or the HTTP server span around the call.
        self._trace_parent = tracing.request_parent(tracing.incoming_traceparent.get())
        self._span = None  # the request's span (kvrelay.common.tracing), while deltas() runs
        self.embedding: tuple[float, ...] | None = None  # a pooling request's vector, once it came

    @property
    def usage(self) -> Usage:
        cached = max((c.num_cached_tokens for c in self.choices), default=0)
        return Usage(len(self.inp.prompt_token_ids), sum(len(c.token_ids) for c in self.choices), cached)

    def route_headers(self) -> dict[str, str]:
        """Where the first choice ran, for callers and tests that check routing."""
        trace = self.traces[0]
        if "decode" not in trace:
            return {}
        return {"x-kvrelay-decode-node": trace["decode"], "x-kvrelay-prefill-node": trace["prefill"] or "local"}

    async def deltas(self) -> AsyncIterator[Delta]:
        if tracing.enabled():
            self._span = tracing.start_span("llm_request", self._trace_parent, self._request_attributes(), server=True)
        error: BaseException | None = None
        with self.core.in_progress(self.principal):
            try:
                decision = None
                if self.run is None or self.run.resume is None:  # (a resumed sequence's node is known)
                    with tracing.span("route", self._span):
                        decision = await self.core.dispatcher.route(
                            self.inp.prompt_token_ids, self.inp.cache_salt, self.deadline, user=self.inp.user,
                            lora_name=self.inp.lora_name, images=self.inp.images)
                if self.inp.beam_search is not None:
                    source = self._beam_stream(decision)
                else:
                    streams = [self._choice_stream(decision, i) for i in range(len(self.choices))]
                    # Choice 0 first: once its prompt is computed, the other choices find it in the prefix caches
                    # instead of each computing (and reserving blocks for) the same prompt at once.
                    source = streams[0] if len(streams) == 1 else merge(streams, lead_first=True)
                async with aclosing(source):
                    async for index, chunk in source:
                        delta = self._consume(index, chunk)
                        if delta is not None:
                            yield delta
            except asyncio.CancelledError as e:
                error = e
                if not self.core.was_cut:
                    raise
                asyncio.current_task().uncancel()  # cut() cancelled us: end as a shutdown, not as a failure
                raise self.core.shutdown_error() from None
            except BaseException as e:
                error = e
                raise
            finally:
                self._finish(error)

    async def _choice_stream(self, decision, index: int) -> AsyncIterator[tuple[int, TokenChunk]]:
        params = self.inp.params
        child = params.for_child(index) if params.n > 1 else params
        run = self.run
        req = EngineRequest(f"{self.request_id}-{index}", self.inp.prompt_token_ids, child, self.inp.cache_salt,
                            deadline=self.deadline, lora_name=self.inp.lora_name, span=self._span,
                            images=self.inp.images, keep_s=run.keep_s if run is not None else 0.0)
        choice = self.choices[index]
        handover = {} if run is None else {
            "resume": run.resume.placement if run.resume is not None else None, "exact": run.exact,
            "placed": lambda placement: run.publish(RunRecord(self.request_id, placement))}
        async with aclosing(self.core.dispatcher.stream(decision, req, self.traces[index], **handover)) as stream:
            async for chunk in stream:
                yield index, chunk
                if choice.finished:  # a stop string ended it: closing the stream aborts it on the node
                    return

    async def _beam_stream(self, decision) -> AsyncIterator[tuple[int, TokenChunk]]:
        local = replace(decision, prefill=None, prefill_fallbacks=())
        req = EngineRequest(f"{self.request_id}-beams", self.inp.prompt_token_ids, self.inp.params,
                            self.inp.cache_salt, beam_search=self.inp.beam_search, deadline=self.deadline,
                            lora_name=self.inp.lora_name, span=self._span)
        async with aclosing(self.core.dispatcher.stream(local, req, self.traces[0])) as stream:
            async for chunk in stream:
                for i, beam in enumerate(chunk.beams[: len(self.choices)]):
                    yield i, TokenChunk(beam.token_ids, (), beam.finish_reason, beam.stop_reason,
                                        chunk.num_prompt_tokens, len(beam.token_ids), chunk.num_cached_tokens)

    def _consume(self, index: int, chunk: TokenChunk) -> Delta | None:
        now = time.perf_counter()
        if chunk.embedding:
            self.embedding = chunk.embedding
        if chunk.token_ids:
            if self._first is None:
                self._first = now
            last = self._last.get(index)
            if last is not None:
                self._itls.append(now - last)
            self._last[index] = now
        delta = self.choices[index].add(chunk)
        if delta.text or delta.token_ids or delta.finish_reason:
            return delta
        return None

    def _request_attributes(self) -> dict:
        """vLLM's span attributes where they exist (gen_ai.*), ours (kvrelay.*) for the rest."""
        p = self.inp.params
        return {"gen_ai.request.id": self.request_id, "gen_ai.request.temperature": p.temperature,
                "gen_ai.request.top_p": p.top_p, "gen_ai.request.max_tokens": p.max_tokens,
                "gen_ai.request.n": p.n, "gen_ai.usage.prompt_tokens": len(self.inp.prompt_token_ids),
                "kvrelay.tenant": self.principal.tenant if self.principal is not None else None,
                "kvrelay.lora_name": self.inp.lora_name or None}

    def _finish(self, error: BaseException | None) -> None:
        """The generation is over: its latency metrics, its tokens to the key's limits, its span, its access log."""
        u, e2e = self.usage, time.perf_counter() - self._start
        ttft = None if self._first is None else self._first - self._start
        if self.core.metrics is not None:
            self.core.metrics.observe_latency(ttft, self._itls, e2e, u.prompt_tokens, u.completion_tokens)
        if self.core.usage_sink is not None:
            self.core.usage_sink(self.principal, u.total_tokens)
        decode, prefill = self.traces[0].get("decode"), self.traces[0].get("prefill")
        tracing.end(self._span, {"gen_ai.usage.completion_tokens": u.completion_tokens,
                                 "kvrelay.cached_tokens": u.cached_tokens, "gen_ai.latency.time_to_first_token": ttft,
                                 "gen_ai.latency.e2e": e2e, "kvrelay.decode_node_id": decode,
                                 "kvrelay.prefill_node_id": prefill}, error)
        if access_log.isEnabledFor(logging.INFO):
            p = self.principal
            status = "ok" if error is None else getattr(error, "code", None) or type(error).__name__
            access_log.info(json.dumps({
                "request_id": self.request_id, "tenant": p.tenant if p else None, "key": p.key_id if p else None,
                "status": status, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "cached_tokens": u.cached_tokens, "ttft_s": None if ttft is None else round(ttft, 4),
                "e2e_s": round(e2e, 4), "decode_node": decode, "prefill_node": prefill,
                "lora": self.inp.lora_name or None}))


async def merge(streams: list[AsyncIterator], lead_first: bool = False) -> AsyncIterator:
    """Interleave several async iterators as their items arrive; the first error ends all of them.
    lead_first: the others start once the first has produced an item (or ended)."""
    queue: asyncio.Queue = asyncio.Queue()
    lead_done = asyncio.Event()
    if not lead_first:
        lead_done.set()

    async def pump(stream, lead: bool) -> None:
        try:
            if not lead:
                await lead_done.wait()
            async with aclosing(stream):
                async for item in stream:
                    await queue.put(item)
                    lead_done.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
            return
        finally:
            lead_done.set()
        await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(s, i == 0)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
