"""Protobuf <-> engine dataclasses, at the server edge only: nothing past the servicer sees a protobuf message.

proto3 cannot tell an unset scalar from its zero, so a few fields read zero as "the default":
n (0 -> 1), top_p (0 -> 1.0), repetition_penalty (0 -> 1.0). temperature 0 means greedy, as in the API.
An absent `params` message means SamplingParams() (temperature 1.0, max_tokens 16); an unset max_tokens
inside a present message means "up to max_model_len", like the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.base import KVLayout
from shared.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from shared.sampler import TokenLogprobs
from shared.sampling_params import SamplingParams
from shared.scheduler_output import EngineCoreOutput

_INT32_MAX = 2**31 - 1


def sampling_from_proto(msg: pb.SamplingParams, present: bool = True) -> SamplingParams:
    """Raises ValueError naming the field when a value is out of range."""
    if not present:
        return SamplingParams()
    return SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        priority=msg.priority,
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, priority=params.priority,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def request_params(request) -> SamplingParams:
    """The SamplingParams of a Reserve / Prefill / Generate request."""
    return sampling_from_proto(request.params, request.HasField("params"))


def prompt_ids(ids: Sequence[int]) -> list[int]:
    return [int(t) for t in ids]


def logprobs_to_proto(lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=top)


def logprobs_from_proto(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank,
        top=tuple((t.token_id, t.logprob) for t in msg.top),
    )


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**layout.to_dict())


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(
        model_id=msg.model_id, dtype=msg.dtype, block_size=msg.block_size, num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads, head_size=msg.head_size, num_blocks=msg.num_blocks,
    )


def chunk_from_output(out: EngineCoreOutput, num_output_tokens: int) -> pb.TokenChunk:
    chunk = pb.TokenChunk(
        token_ids=list(out.new_token_ids),
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.logprobs is not None:
        chunk.logprobs.append(logprobs_to_proto(out.logprobs))
    if out.stop_reason is not None:
        chunk.stop_reason = out.stop_reason
    return chunk


def check_token_ids(name: str, ids: Sequence[int]) -> None:
    """Token ids arrive as int32: a negative one is a client bug worth naming before the engine sees it."""
    bad = [t for t in ids if t < 0 or t > _INT32_MAX]
    if bad:
        raise ValueError(f"{name}: negative token ids {bad[:8]}")
