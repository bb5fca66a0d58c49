"""The proposer interface: what drafts a request's next tokens for the target model to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class ProposeRequest:
    """A request to draft for, after this step's verification and sample."""

    req_id: str
    token_ids: Sequence[int]  # every known token, this step's new ones included
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: Sequence[int]  # its block table (slots for the draft's own KV, if it has any)


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]
    # The distribution each draft was sampled from, [len(token_ids), V], for rejection sampling; None: the
    # drafts are certain (a point mass, as n-gram lookup's are).
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Runs inside the model runner: it sees the scheduler output (to follow block tables) and, after each
    step's sampling, drafts up to `num_speculative_tokens` tokens for the requests the scheduler names."""

    kv_bytes_per_block: int = 0  # KV memory of its own per block (a draft model's), beside the target's
    kv_caches: list[torch.Tensor] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Its own KV cache, indexed by the target's block ids (nothing for a proposer without a model)."""
        return None

    def on_schedule(self, sched: SchedulerOutput) -> None:
        """Follow the scheduler's decisions (new, resumed, preempted and finished requests)."""
        return None

    @abstractmethod
    def propose(self, requests: Sequence[ProposeRequest]) -> dict[str, Draft]:
        """Drafts per request (empty or absent: nothing to propose)."""
