"""POST /v1/embeddings: OpenAI's schema (`input` as text, texts, token ids or lists of them; `encoding_format`
float or base64; `dimensions`), plus vLLM's `normalize`.

Each input is one pooling request (kvrelay.engine.pooling) through the same admission, routing (prefix affinity
included: a decoder embedder's prompt KV serves a later chat with the same prefix) and node failover as a
completion; it runs where its prompt is computed, never handed from a prefill node. The model folder says how
it pools (model_files.pooling); inputs run at most MAX_PARALLEL at a time, so one large batch does not take every
admission slot at once.
"""

from __future__ import annotations

import asyncio
import base64
from contextlib import aclosing
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from kvrelay.common.sampling_params import PoolingParams, PoolingType, SamplingParams
from kvrelay.gateway.core import GatewayCore, GenerateInput, Generation, new_request_id
from kvrelay.gateway.errors import BadRequest, NodeFailure
from kvrelay.gateway.models import Target
from kvrelay.gateway.outputs import OutputOptions
from kvrelay.gateway.serving_common import json_response, request_id_headers
from kvrelay.model_files.pooling import PoolingConfig

MAX_INPUTS = 2048  # OpenAI's limit per request
MAX_PARALLEL = 32


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    normalize: bool = True  # vLLM's: to unit length, as OpenAI's embeddings are


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EmbeddingServing:
    def __init__(self, core: GatewayCore, pooling: PoolingConfig) -> None:
        self.core = core
        self.pooling = pooling

    async def create(self, req: EmbeddingRequest, target: Target, header_request_id: str | None = None) -> Response:
        request_id = header_request_id or new_request_id("embd")
        pooling = self.embedding_params(req.normalize, req.dimensions, target.name)
        inputs = self.encode(req.input, "input")
        vectors = await self.vectors(inputs, target, request_id, pooling, req.user)
        data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in inputs)
        body = EmbeddingResponse(data=data, model=target.name, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                                      total_tokens=tokens))
        return json_response(body, request_id_headers(header_request_id))

    def embedding_params(self, normalize: bool, dimensions: int | None, model: str) -> PoolingParams:
        """How this model embeds; a 400 for a cross-encoder, which cannot, or for more dimensions than it has."""
        if self.pooling.num_labels:
            raise BadRequest(f"model: {model} is a cross-encoder (a classification head), which cannot embed; "
                             "use /v1/score or /v1/rerank with it", param="model")
        hidden = self.pooling.hidden_size
        if dimensions is not None and hidden and dimensions > hidden:
            raise BadRequest(f"dimensions: {dimensions} is more than the model's {hidden}", param="dimensions")
        return PoolingParams(PoolingType(self.pooling.pooling_type), normalize, dimensions)

    async def vectors(self, inputs: list[list[int]], target: Target, request_id: str, pooling: PoolingParams,
                      user: str | None = None) -> list[tuple[float, ...]]:
        """Each input's vector, at most MAX_PARALLEL computing at once; the first error is the answer (400, 429,
        502, ...) and the others stop (their requests abort on the nodes)."""
        params = SamplingParams(max_tokens=1, pooling=pooling)
        gate = asyncio.Semaphore(MAX_PARALLEL)

        async def one(i: int, ids: list[int]) -> tuple[float, ...]:
            async with gate:
                gen = self.core.generate(GenerateInput(ids, params, OutputOptions(), request_id=f"{request_id}-{i}",
                                                       user=user, lora_name=target.lora_name))
                return await _vector(gen)

        tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(inputs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def encode(self, x: str | list[str] | list[int] | list[list[int]], param: str) -> list[list[int]]:
        """Texts or token lists as token lists, each checked against the vocabulary and the context."""
        if isinstance(x, str):
            texts: list = [x]
        elif x and all(isinstance(t, int) for t in x):
            texts = [list(x)]
        else:
            texts = list(x)
        if not texts:
            raise BadRequest(f"{param}: give at least one text or token list", param=param)
        out = [self.core.tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
        self.check(out, param)
        return out

    def check(self, inputs: list[list[int]], param: str) -> None:
        """At most MAX_INPUTS inputs, each within the vocabulary and the context."""
        if len(inputs) > MAX_INPUTS:
            raise BadRequest(f"{param}: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param=param)
        limit = self.core.max_model_len
        for ids in inputs:
            self.core.check_prompt(ids, param)
            if len(ids) > limit:
                raise BadRequest(f"{param}: {len(ids)} tokens exceed this model's maximum context length of {limit}",
                                 param=param)


async def _vector(gen: Generation) -> tuple[float, ...]:
    async with aclosing(gen.deltas()) as deltas:
        async for _ in deltas:
            pass
    if gen.embedding is None:
        raise NodeFailure("the node answered with tokens, not an embedding (a node without pooling support)",
                          node_id=gen.traces[0].get("decode"))
    return gen.embedding


def _encode(vector: tuple[float, ...], fmt: str) -> list[float] | str:
    """base64: the float32 values' little-endian bytes, as OpenAI sends them (the SDK's default)."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)
