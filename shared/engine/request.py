"""An engine request: ids and counts the scheduler reasons about (no tensors), and its stop conditions."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvrelay.common.records import BlockHash, ImageInput
from kvrelay.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks reserved, a prefill node is filling them
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued, but its grammar is still compiling
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    # By value: an enum member's hash is a Python-level call, and these run for every request of every step.
    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED

    @property
    def computing(self) -> bool:
        """Queued for, or in, a step (not a reservation, a compiling grammar or a finished request)."""
        return self._value_ in _COMPUTING


_FINISHED = frozenset({"stop", "length", "abort"})
_COMPUTING = frozenset({"waiting", "preempted", "running"})


@dataclass(frozen=True)
class KVSendSpec:
    """Prefill role: where this request's prompt KV goes. The peer already holds the first
    `skip_blocks` blocks; the rest go to `dst_block_ids` in its cache."""

    peer: str
    transfer_id: str
    skip_blocks: int
    dst_block_ids: tuple[int, ...]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str = ""
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model); part of its block hashes
    images: tuple[ImageInput, ...] = ()  # its prompt's images, in order; part of its block hashes

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it, if any
    kv_send: KVSendSpec | None = None
    kv_send_started: bool = False  # its blocks may be in flight: hold them past the request's end
    max_tokens: int | None = None  # effective limit on generated tokens (resumed ones included); None: no limit
    kv_received: bool = False  # decode role: its prompt's KV came from a prefill node (until preempted)
    # Speculative decoding: drafts proposed for the tokens after the known ones, verified next step.
    spec_token_ids: list[int] = field(default_factory=list)
    beam_group: str | None = None  # beam search: the group this beam belongs to

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.max_tokens is None:
            self.max_tokens = self.sampling_params.max_tokens
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_resumed_tokens(self) -> int:
        """Prompt tokens that are output generated before the request moved here (migration)."""
        return self.sampling_params.num_resumed_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Output as the stop conditions see it: what this engine sampled plus what it resumed from."""
        return self.sampling_params.num_resumed_tokens + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status._value_ in _FINISHED  # RequestStatus.finished, one call less: read every row of every step

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_sampled(self, tokens: Sequence[int], max_model_len: int) -> tuple[int, ...]:
        """Append sampled tokens until a stop condition ends the request; returns those appended (tokens
        after a stop token in an accepted run of drafts are dropped)."""
        # Runs for every request of every step: the appends inline, and the stop check says whether it ended it.
        out, everything = self.output_token_ids, self.all_token_ids
        if len(tokens) == 1:  # no speculation: one token
            token = tokens[0]
            out.append(token)
            everything.append(token)
            self._check_stop(token, max_model_len)
            return tuple(tokens)
        for i, token in enumerate(tokens):
            out.append(token)
            everything.append(token)
            if self._check_stop(token, max_model_len):
                return tuple(tokens[: i + 1])
        return tuple(tokens)

    def _check_stop(self, token: int, max_model_len: int) -> bool:
        """End the request if this token (just appended) meets a stop condition; True when it did."""
        # Length first, as vLLM does: a stop token that is also the last allowed token ends as "length".
        params = self.sampling_params
        generated = params.num_resumed_tokens + len(self.output_token_ids)  # a resumed request's output counts
        if (self.max_tokens is not None and generated >= self.max_tokens) or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        if generated < params.min_tokens:
            return False
        if token == self.eos_token_id and not params.ignore_eos:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token
            return True
        return False

    @property
    def finish_reason(self) -> str | None:
        value = self.status._value_
        return value if value in _FINISHED else None
