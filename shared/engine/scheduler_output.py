"""Plain frozen records passed between scheduler, model runner and engine: ids and counts only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state is rebuilt)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt plus any output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # before this step (prefix-cache hits included)


@dataclass(frozen=True)
class CachedRequestData:
    req_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int  # before this step


@dataclass(frozen=True)
class KVSend:
    """Send these blocks, layer by layer as the step computes them, to a peer's blocks."""

    req_id: str
    transfer_id: str
    peer: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    new_reqs: tuple[NewRequestData, ...]
    cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]
    kv_sends: tuple[KVSend, ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    logprobs: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    # With a request's first sampled token: (None, then TokenLogprobs per prompt token after the first).
    prompt_logprobs: Mapping[str, tuple] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: tuple[int, ...]
    logprobs: object | None  # shared.engine.sampler.TokenLogprobs
    finish_reason: str | None
    stop_reason: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: tuple | None = None  # with the first token, when asked: (None, TokenLogprobs, ...)


@dataclass(frozen=True)
class Reservation:
    """Decode role: blocks set aside for a request whose KV a prefill node will write."""

    req_id: str
    num_cached_tokens: int  # leading prompt tokens already held here (prefix cache)
    dst_block_ids: tuple[int, ...]  # the blocks after those, for the transfer to fill
    deadline: float
