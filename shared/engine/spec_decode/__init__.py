"""Speculative decoding: proposers (a factory keyed by method name) and the exact verification, run by the
model runner; what speculation adds to the scheduler's plan is scheduling.py's `Speculation`.

    ngram         prompt lookup over the request's own tokens (ngram.py)
    draft_model   a smaller model with the same vocabulary and its own paged KV (draft_model.py)
"""

from __future__ import annotations

import torch

from kvrelay.engine.config import EngineConfig
from kvrelay.engine.spec_decode.base import Draft, Proposer, ProposeRequest
from kvrelay.engine.spec_decode.verify import Verified, Verifier, VerifyGroup

__all__ = ["Draft", "Proposer", "ProposeRequest", "Verified", "Verifier", "VerifyGroup", "create_proposer"]


def _ngram(config: EngineConfig, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Proposer:
    from kvrelay.engine.spec_decode.ngram import NgramProposer

    return NgramProposer(config.speculative)


def _draft_model(config: EngineConfig, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Proposer:
    from kvrelay.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, vocab_size, dtype, device)


PROPOSERS = {"ngram": _ngram, "draft_model": _draft_model}


def create_proposer(config: EngineConfig, vocab_size: int, dtype: torch.dtype, device: torch.device) -> Proposer:
    """The proposer `config.speculative.method` names (the target's vocabulary, dtype and device given)."""
    spec = config.speculative
    if spec is None:
        raise ValueError("speculative_config: not set")
    try:
        factory = PROPOSERS[spec.method]
    except KeyError:
        raise ValueError(f"speculative_config.method: {spec.method!r} is not one of {', '.join(PROPOSERS)}") from None
    return factory(config, vocab_size, dtype, device)
