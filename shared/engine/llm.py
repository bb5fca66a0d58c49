"""Offline inference: `LLM(model="default").generate(prompts, SamplingParams(...))`, and
`LLM(...).beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))` as vLLM has them.

Speculative decoding: `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`.
LoRA: `LLM(..., enable_lora=True, max_loras=4)` and `generate(..., lora_request=LoRARequest("name", 1, "/path"))`
(one for all prompts, or one per prompt; None runs the base model).
Images (a vision-language model), as vLLM takes them: `generate({"prompt": "USER: <image>\nWhat is it?",
"multi_modal_data": {"image": image}})`, an image being PIL image or encoded bytes (a list for several, one per
`<image>` in the prompt), and `chat(messages)` with OpenAI `image_url` parts holding data: URLs."""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import BeamSearchParams, PoolingParams, SamplingParams
from kvrelay.common.tokenizer import Tokenizer
from kvrelay.engine.config import engine_config_from_kwargs
from kvrelay.engine.core import EngineCore
from kvrelay.engine.lora import LoRARequest
from kvrelay.engine.scheduler_output import EngineCoreOutput
from kvrelay.model_files.vision import ImageError, data_url_bytes, expand_images

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput", "BeamSearchOutput",
           "BeamSearchSequence", "LoRARequest"]

Prompt = str | Sequence[int]
# A prompt with images: {"prompt": str} or {"prompt_token_ids": [...]}, and {"multi_modal_data": {"image": ...}}
PromptInput = Prompt | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None  # per token: kvrelay.engine.sampler.TokenLogprobs
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


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's record of `LLM.embed`: `outputs.embedding` is the vector."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM reports it: `tokens` are the prompt's and the generated ones; `text` the generated
    text without a final end token."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str
    stop_reason: int | None = None
    score: float = 0.0  # the length-penalised score the beams are ranked by
    logprobs: list = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class LLM:
    def __init__(self, model: str = "default", dtype: str = "auto", **engine_kwargs) -> None:
        self.engine = EngineCore(engine_config_from_kwargs(model, dtype, **engine_kwargs))
        self.tokenizer = Tokenizer(self.engine.info.path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, dict) else _as_list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        inputs = [self._encode_input(p) for p in prompts]
        loras = self._lora_names(lora_request, len(prompts))
        # Validate everything first: a bad prompt must not leave the others half-queued.
        for (ids, images), sp, lora in zip(inputs, params, loras):
            self.engine.validate(ids, sp)
            self.engine.check_images(ids, images)
            self.engine.check_lora(lora)
            if sp.structured_outputs is not None:
                self.engine.compile_grammar(sp.structured_outputs).result()  # ValueError for a bad grammar
        results: dict[str, RequestOutput] = {}
        children: dict[str, tuple[str, int]] = {}
        for prompt, (ids, images), sp, lora in zip(prompts, inputs, params, loras):
            rid = str(next(self._ids))
            text = _prompt_of(prompt)
            results[rid] = RequestOutput(rid, text if isinstance(text, str) else None, ids, [])
            for i, child in enumerate(self.engine.add_request(rid, ids, sp, lora_name=lora, images=images)):
                children[child] = (rid, i)
                results[rid].outputs.append(CompletionOutput(i, "", [], [] if sp.logprobs is not None else None, None))
        self._run(results, children, use_tqdm)
        for out in results.values():
            for comp in out.outputs:
                comp.text = self.tokenizer.decode(comp.token_ids)
            out.finished = True
        return list(results.values())

    def _lora_names(self, requests, n: int) -> list[str]:
        """Each prompt's adapter name; an adapter the engine does not know yet is read from its path."""
        if requests is None or isinstance(requests, LoRARequest):
            requests = [requests] * n
        requests = list(requests)
        if len(requests) != n:
            raise ValueError(f"lora_request: got {len(requests)} for {n} prompts")
        for req in {r for r in requests if r is not None}:
            known = self.engine.lora is not None and req.lora_name in self.engine.lora.names()
            if not known and req.lora_path:
                self.engine.add_lora(req.lora_name, self.engine.read_lora(req.lora_name, req.lora_path))
        return [r.lora_name if r is not None else "" for r in requests]

    def beam_search(
        self, prompts: Prompt | dict | Sequence[Prompt | dict], params: BeamSearchParams, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...})."""
        prompts = [prompts] if isinstance(prompts, dict) else _as_list(prompts)
        encoded = [self._encode(_prompt_of(p)) for p in prompts]
        for ids in encoded:
            self.engine.validate(ids, SamplingParams())
        rids = [str(next(self._ids)) for _ in encoded]
        for rid, ids in zip(rids, encoded):
            self.engine.add_beam_search(rid, ids, params)
        done: dict[str, object] = {}
        bar = tqdm(total=len(rids), desc="beam search", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finish_reason is not None:
                        done[out.req_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort(rids)
            raise
        finally:
            bar.close()
        end_ids = set() if params.ignore_eos else {self.engine.info.eos_token_id, *self.engine.info.extra_eos_token_ids}
        return [BeamSearchOutput([self._sequence(ids, beam, end_ids) for beam in done[rid].beams])
                for rid, ids in zip(rids, encoded)]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (last-token pooling, normalised, unless `pooling_params` says otherwise)."""
        params = SamplingParams(pooling=pooling_params or PoolingParams())
        encoded = [self._encode(p) for p in _as_list(prompts)]
        for ids in encoded:
            self.engine.validate(ids, params)
        results = {str(next(self._ids)): ids for ids in encoded}
        for rid, ids in results.items():
            self.engine.add_request(rid, ids, params)
        vectors: dict[str, list[float]] = {}
        bar = tqdm(total=len(results), desc="embeddings", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.pooled is not None:
                        vectors[out.req_id] = list(out.pooled)
                        bar.update(1)
        except BaseException:
            self.engine.abort(list(results))
            raise
        finally:
            bar.close()
        return [EmbeddingRequestOutput(rid, ids, EmbeddingOutput(vectors[rid])) for rid, ids in results.items()]

    def _sequence(self, prompt: list[int], beam, end_ids: set) -> BeamSearchSequence:
        gen = list(beam.token_ids)
        text_ids = gen[:-1] if gen and gen[-1] in end_ids else gen
        return BeamSearchSequence([*prompt, *gen], beam.cumulative_logprob, self.tokenizer.decode(text_ids),
                                  beam.finish_reason, beam.stop_reason, beam.score)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        """Chats rendered by the model's template; content may be OpenAI parts (text, and image_url with a data:
        URL, each image shown as the model's placeholder where it stands)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            rendered, images = _chat_parts(conv, self.engine.vision.image_token if self.engine.vision else None)
            ids = self.tokenizer.apply_chat_template(rendered)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _encode_input(self, prompt: PromptInput) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Token ids, and the images at their positions (each `<image>` widened to its tokens)."""
        ids = self._encode(_prompt_of(prompt))
        images = _image_bytes((prompt.get("multi_modal_data") or {}).get("image")) if isinstance(prompt, dict) else []
        if not images:
            return ids, ()
        if self.engine.vision is None:
            raise ValueError(f"multi_modal_data: {self.engine.info.architecture} takes no images")
        return expand_images(ids, self.engine.vision, images)

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
        if comp.logprobs is not None:
            comp.logprobs.extend(out.logprobs)
        res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            comp.finish_reason = out.finish_reason
            comp.stop_reason = out.stop_reason
            return True
        return False


def _image_bytes(images) -> list[bytes]:
    """multi_modal_data["image"]: one image or a list, each encoded bytes or a PIL image (saved as PNG)."""
    if images is None:
        return []
    out = []
    for image in images if isinstance(images, (list, tuple)) else [images]:
        if isinstance(image, (bytes, bytearray)):
            out.append(bytes(image))
        elif hasattr(image, "save"):
            buffer = io.BytesIO()
            image.save(buffer, "PNG")
            out.append(buffer.getvalue())
        else:
            raise ValueError(f"multi_modal_data: an image is encoded bytes or a PIL image, not {type(image).__name__}")
    return out


def _chat_parts(messages: list[dict], placeholder: str | None) -> tuple[list[dict], list[bytes]]:
    """Messages whose content lists are joined into text (an image part as `placeholder`), and their images."""
    rendered, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") == "image_url":
                    if placeholder is None:
                        raise ValueError("image_url: this model takes no images")
                    try:
                        images.append(data_url_bytes((part.get("image_url") or {}).get("url", "")))
                    except ImageError as e:
                        raise ValueError(f"image_url: offline, an image is a data: URL; {e}") from None
                    texts.append(placeholder)
                else:
                    texts.append(part.get("text", ""))
            m = {**m, "content": "\n".join(texts)}
        rendered.append(m)
    return rendered, images


def _prompt_of(prompt: Prompt | dict) -> Prompt:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


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

