"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, find the latest earlier occurrence of the request's
last n tokens in its prompt and output; propose the tokens that followed it. Copy-heavy work (editing,
summarising, refactoring a given text) repeats long spans of its input, which this finds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvrelay.engine.config import SpeculativeConfig
from kvrelay.engine.spec_decode.base import Draft, Proposer, ProposeRequest


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The up to k tokens after the latest earlier match of the longest suffix n-gram (n in [n_min, n_max])."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        # Windows start at 0 .. size-1-n, so a match always has at least one token after it.
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Sequence[ProposeRequest]) -> dict[str, Draft]:
        out = {}
        for r in requests:
            tokens = ngram_lookup(np.asarray(r.token_ids, dtype=np.int64), self.n_min, self.n_max, self.k)
            if tokens:
                out[r.req_id] = Draft(tuple(tokens))
        return out
