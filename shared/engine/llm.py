"""Offline inference: `LLM(model="default").generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from shared.config import engine_config_from_kwargs
from shared.engine.core import EngineCore
from shared.engine.scheduler_output import EngineCoreOutput
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None  # per token: shared.engine.sampler.TokenLogprobs
    finish_reason: str | None
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: tuple | None = None  # (None, TokenLogprobs per later prompt token) when asked
    metrics: dict = field(default_factory=dict)


class LLM:
    def __init__(self, model: str = "default", dtype: str = "auto", **engine_kwargs) -> None:
        self.engine = EngineCore(engine_config_from_kwargs(model, dtype, **engine_kwargs))
        self.tokenizer = Tokenizer(self.engine.info.path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        # Validate everything first: a bad prompt must not leave the others half-queued.
        for ids, sp in zip(encoded, params):
            self.engine.validate(ids, sp)
            if sp.structured_outputs is not None:
                self.engine.compile_grammar(sp.structured_outputs).result()  # ValueError for a bad grammar
        results: dict[str, RequestOutput] = {}
        children: dict[str, tuple[str, int]] = {}
        for prompt, ids, sp in zip(prompts, encoded, params):
            rid = str(next(self._ids))
            results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids, [])
            for i, child in enumerate(self.engine.add_request(rid, ids, sp)):
                children[child] = (rid, i)
                results[rid].outputs.append(CompletionOutput(i, "", [], [] if sp.logprobs is not None else None, None))
        self._run(results, children, use_tqdm)
        for out in results.values():
            for comp in out.outputs:
                comp.text = self.tokenizer.decode(comp.token_ids)
            out.finished = True
        return list(results.values())

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _run(self, results: dict, children: dict, use_tqdm: bool) -> None:
        bar = tqdm(total=len(children), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if self._absorb(results, children, out):
                        bar.update(1)
        except BaseException:
            self.engine.abort(list(children))
            raise
        finally:
            bar.close()

    @staticmethod
    def _absorb(results: dict, children: dict, out: EngineCoreOutput) -> bool:
        rid, index = children[out.req_id]
        res = results[rid]
        comp = res.outputs[index]
        comp.token_ids.extend(out.new_token_ids)
        if comp.logprobs is not None and out.logprobs is not None:
            comp.logprobs.append(out.logprobs)
        res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            comp.finish_reason = out.finish_reason
            comp.stop_reason = out.stop_reason
            return True
        return False


def _as_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return params

