"""POST /v1/score (vLLM's) and /v1/rerank (Jina's and Cohere's shape, as vLLM serves it), as vLLM scores:
- with a cross-encoder (a *ForSequenceClassification model with one output), the pair is one sequence (the
  tokenizer's pair template) and its score the sigmoid of the head's output on its last token;
- with an embedding model, the cosine similarity of the two texts' embeddings (serving_embeddings).

score: `text_1` one text against each of `text_2`, or two lists of equal length pair by pair.
rerank: `query` against every document, best first, the first `top_n`, with the documents' texts unless
`return_documents` is false.
"""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from kvrelay.common.sampling_params import PoolingParams, PoolingType
from kvrelay.gateway.core import new_request_id
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.models import Target
from kvrelay.gateway.serving_common import json_response, request_id_headers
from kvrelay.gateway.serving_embeddings import EmbeddingServing


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreServing:
    def __init__(self, embeddings: EmbeddingServing) -> None:
        self.embeddings = embeddings

    async def score(self, req: ScoreRequest, target: Target, header_request_id: str | None = None) -> Response:
        request_id = header_request_id or new_request_id("score")
        left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right) or not right:
            raise BadRequest(f"text_1: {len(left)} texts for the {len(right)} of text_2 (give one text, or as many)",
                             param="text_1")
        scores, tokens = await self._cosines(left, right, target, request_id, req.user, "text_2")
        body = ScoreResponse(id=request_id, created=int(time.time()), model=target.name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))
        return json_response(body, request_id_headers(header_request_id))

    async def rerank(self, req: RerankRequest, target: Target, header_request_id: str | None = None) -> Response:
        request_id = header_request_id or new_request_id("rerank")
        if not req.documents:
            raise BadRequest("documents: give at least one document", param="documents")
        scores, tokens = await self._cosines([req.query] * len(req.documents), req.documents, target, request_id,
                                             req.user, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        body = RerankResponse(id=request_id, model=target.name, results=results, usage=RerankUsage(total_tokens=tokens))
        return json_response(body, request_id_headers(header_request_id))

    async def _cosines(self, left: list[str], right: list[str], target: Target, request_id: str,
                       user: str | None, param: str) -> tuple[list[float], int]:
        """Each pair's score, and the tokens computed: a cross-encoder's on the pair, else the cosine similarity of
        the texts' embeddings (each distinct text embedded once)."""
        emb = self.embeddings
        if emb.pooling.num_labels:
            if emb.pooling.num_labels != 1:
                raise BadRequest(f"model: {target.name} classifies into {emb.pooling.num_labels} labels; scoring "
                                 "needs a cross-encoder with one output", param="model")
            pairs = [emb.core.tokenizer.encode_pair(a, b) for a, b in zip(left, right, strict=True)]
            emb.check(pairs, param)
            scores = await emb.vectors(pairs, target, request_id, PoolingParams(PoolingType.CLASSIFY), user)
            return [s[0] for s in scores], sum(len(ids) for ids in pairs)
        texts = list(dict.fromkeys([*left, *right]))
        encoded = emb.encode(texts, param)
        vectors = dict(zip(texts, await emb.vectors(encoded, target, request_id, PoolingParams(), user), strict=True))
        scores = [_cosine(vectors[a], vectors[b]) for a, b in zip(left, right, strict=True)]
        return scores, sum(len(ids) for ids in encoded)


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
