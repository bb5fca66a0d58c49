"""Plain records passed between scheduler, model runner and engine: ids and counts only (frozen, but for
the engine's running counters)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from kvrelay.common.records import BeamSequence, ImageInput, TokenLogprobs
from kvrelay.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrelay.engine.request import Request

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its state is rebuilt)."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt plus any output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # before this step (prefix-cache hits included)
    # Of those, the trailing ones whose KV arrived from a prefill node: a draft model has none of its own
    # KV for them and computes it.
    num_external_tokens: int = 0
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    images: tuple[ImageInput, ...] = ()  # its prompt's images (a vision-language model encodes them)


class CachedRequestData(NamedTuple):
    """A running request the runner already has: the blocks it gained this step. A named tuple: one is made
    per running request per step, at a third of a frozen dataclass's cost."""

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
    # Speculative decoding: the draft tokens each request verifies this step (counted in its scheduled
    # tokens, after its known tokens), and the requests whose proposer drafts their next tokens after
    # sampling.
    scheduled_spec_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: _EMPTY)
    propose_req_ids: frozenset[str] = frozenset()
    # Copy-on-write (beam search): copy each (src, dst) block's KV, every layer, before the forward pass.
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per request that reached the end of its known tokens: the tokens it gained (the accepted drafts
    then one sampled token; just one without speculation), their logprobs when asked for, and the drafts
    its proposer made for the next step."""

    sampled_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: _EMPTY)
    logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = field(default_factory=lambda: _EMPTY)
    spec_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: _EMPTY)
    # With a request's first sampled token: (None, then TokenLogprobs per prompt token after the first).
    prompt_logprobs: Mapping[str, tuple] = field(default_factory=lambda: _EMPTY)
    pooled: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: _EMPTY)  # pooling requests done


@dataclass(slots=True)
class EngineCoreOutput:
    """Not frozen, by measurement: one is made per request per step, and a frozen dataclass's __init__ costs
    ~2.4 us against ~0.4 us (its fields are set through object.__setattr__). Nothing changes one once made."""

    req_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]  # one per new token when asked for, else empty
    finish_reason: str | None
    stop_reason: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: tuple | None = None  # with the first token, when asked: (None, TokenLogprobs, ...)
    beams: tuple[BeamSequence, ...] = ()  # beam search: the finished beams, best first (in the last output)
    pooled: tuple[float, ...] | None = None  # a pooling request's vector (its only output; no tokens)

    @classmethod
    def of(cls, req: Request, new_token_ids: tuple[int, ...], logprobs: Iterable[TokenLogprobs] = (),
           prompt_logprobs: tuple | None = None, pooled: tuple[float, ...] | None = None) -> EngineCoreOutput:
        """A request's new tokens, and how it finished if it did."""
        return cls(req.request_id, new_token_ids, tuple(logprobs), req.finish_reason, req.stop_reason,
                   req.num_prompt_tokens, req.num_cached_tokens or 0, prompt_logprobs, pooled=pooled)


@dataclass
class EngineCounters:
    """Cumulative counts for the metrics (the load itself is counted on demand: `Scheduler.load`)."""

    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    # Speculative decoding (vLLM's spec_decode metrics): verifications, drafts verified, drafts accepted,
    # and accepted drafts by position in their run (index 0: the first draft of a run).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # A vision-language model's images: encoded here, and the time decoding, preprocessing and encoding took.
    images_encoded: int = 0
    image_encoder_seconds: float = 0.0

    def count_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        if len(self.spec_accepted_per_pos) < num_drafts:
            self.spec_accepted_per_pos.extend([0] * (num_drafts - len(self.spec_accepted_per_pos)))
        for i in range(num_accepted):
            self.spec_accepted_per_pos[i] += 1


@dataclass(frozen=True)
class Reservation:
    """Decode role: blocks set aside for a request whose KV a prefill node will write."""

    req_id: str
    num_cached_tokens: int  # leading prompt tokens already held here (prefix cache)
    dst_block_ids: tuple[int, ...]  # the blocks after those, for the transfer to fill
    deadline: float
