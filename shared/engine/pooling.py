"""Pooling requests (embeddings): a request whose SamplingParams carry `pooling` ends when its prompt is computed,
with one vector made from the final hidden states (the final norm's output, as HF's last_hidden_state) instead of
a sampled token.

The model runner hands the Pooler each step's rows of every pooling request: a mean needs every prompt position
(so such a prompt never starts from the prefix cache, as with prompt logprobs: request_table), the first token's
row is kept for CLS, and the last one's comes with the step that completes the prompt. Chunked prefill and
preemption are transparent: the runner drops a request's partial sums when the scheduler drops its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrelay.common.sampling_params import PoolingParams, PoolingType


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._first: dict[str, torch.Tensor] = {}

    def observe(self, rid: str, params: PoolingParams, rows: torch.Tensor, start: int) -> None:
        """`rows`: the request's hidden states this step, for positions start, start + 1, ..."""
        if params.pooling_type == PoolingType.MEAN:
            part = rows.float().sum(dim=0)
            self._sums[rid] = part if rid not in self._sums else self._sums[rid] + part
        elif params.pooling_type == PoolingType.CLS and start == 0:
            self._first[rid] = rows[0].float()

    def finish(self, rid: str, params: PoolingParams, last: torch.Tensor, num_tokens: int) -> tuple[float, ...]:
        """The request's vector, once its prompt (`num_tokens` positions; `last`: the last one's row, for CLASSIFY
        the classification head's outputs on it) is done."""
        if params.pooling_type == PoolingType.CLASSIFY:  # as sentence-transformers' CrossEncoder and vLLM score
            out = torch.sigmoid(last.float()) if last.numel() == 1 else torch.softmax(last.float(), dim=-1)
            return tuple(out.tolist())
        if params.pooling_type == PoolingType.MEAN:
            vec = self._sums.pop(rid) / num_tokens
        elif params.pooling_type == PoolingType.CLS:
            vec = self._first.pop(rid)
        else:
            vec = last.float()
        if params.dimensions is not None:
            vec = vec[: params.dimensions]
        if params.normalize:
            vec = F.normalize(vec, dim=-1)
        return tuple(vec.tolist())

    def drop(self, rid: str) -> None:
        """The request finished or was preempted: what it accumulated is void."""
        self._sums.pop(rid, None)
        self._first.pop(rid, None)
