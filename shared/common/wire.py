"""The engine service's wire format: its records, and every protobuf <-> record conversion, once.

Node servers and the gateway's node client both convert here, so the two sides cannot drift apart; past the
servicer and the client nothing sees a protobuf message.

proto3 cannot tell an unset scalar from its zero, so a few fields read zero as "the default":
n (0 -> 1), top_p (0 -> 1.0), repetition_penalty (0 -> 1.0). temperature 0 means greedy, as in the API.
An absent `params` message means SamplingParams() (temperature 1.0, max_tokens 16); an unset max_tokens
inside a present message means "up to max_model_len", like the OpenAI API.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.common.records import BeamSequence, ImageInput, KVLayout, NodeLoad, TokenLogprobs
from kvrelay.common.sampling_params import (
    BeamSearchParams,
    PoolingParams,
    PoolingType,
    SamplingParams,
    StructuredOutputs,
)
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb

_INT32_MAX = 2**31 - 1

# Every error a node returns itself carries this trailing metadata key, valued with a NodeErrorKind: an
# error without it never reached the node's code (connection refused, reset, deadline on the wire), which
# is what tells the gateway a dead or hung node from a live one that said no.
NODE_ERROR_KEY = "kvrelay-node-error"


class NodeErrorKind(str, enum.Enum):
    NODE = "node"  # anything else the node answered (bad input, a bug)
    DRAINING = "draining"  # shutting down: takes no new work, finishes what it has
    FULL = "full"  # no room now and no room to wait (RESOURCE_EXHAUSTED)
    DUPLICATE = "duplicate"  # the request id is in use on the node (ALREADY_EXISTS)
    HANDOFF = "handoff"  # the node is fine; the KV transfer between two nodes failed


# ------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    role: str
    model_id: str
    block_size: int
    max_model_len: int = 0
    vocab_size: int = 0
    capacity_tokens: int = 0
    connector: str = ""
    kv_address: str = ""
    grpc_address: str = ""
    metrics_address: str = ""
    dtype: str = ""
    layout: KVLayout | None = None
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it holds
    max_loras: int = 0  # adapters one step runs (0: LoRA is off)
    max_lora_rank: int = 0
    lora_capacity: int = 0  # adapters kept in memory


@dataclass(frozen=True)
class Health:
    healthy: bool
    draining: bool = False
    message: str = ""


@dataclass(frozen=True)
class ReserveResult:
    """A decode node's answer to Reserve: where the prefill node writes the prompt's KV."""

    request_id: str
    node_id: str
    kv_address: str
    num_cached_tokens: int  # leading prompt tokens whose KV the decode node already holds
    dst_block_ids: tuple[int, ...]
    layout: KVLayout | None
    lease_expires_unix_ms: int = 0
    transfer_id: str = ""  # what the prefill node sends the KV under (the request id and a secret)


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    num_cached_tokens: int
    bytes_transferred: int = 0
    transfer_seconds: float = 0.0
    prefill_seconds: float = 0.0
    finish_reason: str = ""  # set when the first token already ends the request
    last_layer_seconds: float = 0.0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # (None, token 1's, ...) when asked


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str = ""  # "", "stop", "length", "abort"
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # first chunk: (None, token 1's, ...)
    beams: tuple[BeamSequence, ...] = ()  # beam search: the finished beams, best first (in the last chunk)
    embedding: tuple[float, ...] = ()  # a pooling request's vector (its only chunk)


# ------------------------------------------------------------------------------------ sampling params


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
        structured_outputs=(StructuredOutputs(msg.structured_outputs.kind, msg.structured_outputs.source)
                            if msg.HasField("structured_outputs") else None),
        logit_bias=tuple(msg.logit_bias.items()),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        num_resumed_tokens=msg.num_resumed_tokens,
        pooling=(PoolingParams(msg.pooling.pooling_type or PoolingType.LAST, msg.pooling.normalize,
                               msg.pooling.dimensions if msg.pooling.HasField("dimensions") else None)
                 if msg.HasField("pooling") else None),
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, priority=params.priority,
        num_resumed_tokens=params.num_resumed_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured_outputs is not None:
        so = params.structured_outputs
        msg.structured_outputs.CopyFrom(pb.StructuredOutputs(kind=so.kind.value, source=so.source))
    if params.logit_bias:
        msg.logit_bias.update(dict(params.logit_bias))
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.pooling is not None:
        p = params.pooling
        msg.pooling.CopyFrom(pb.PoolingParams(pooling_type=p.pooling_type.value, normalize=p.normalize))
        if p.dimensions is not None:
            msg.pooling.dimensions = p.dimensions
    return msg


_EARLY_STOPPING = {"": False, "false": False, "true": True, "never": "never"}


def beam_search_to_proto(params: BeamSearchParams) -> pb.BeamSearchParams:
    early = params.early_stopping
    return pb.BeamSearchParams(
        beam_width=params.beam_width, max_tokens=params.max_tokens, length_penalty=params.length_penalty,
        ignore_eos=params.ignore_eos, early_stopping="never" if early == "never" else str(bool(early)).lower(),
    )


def beam_search_from_proto(msg: pb.BeamSearchParams) -> BeamSearchParams:
    """Raises ValueError naming the field when a value is out of range."""
    if msg.early_stopping not in _EARLY_STOPPING:
        raise ValueError(f"early_stopping: must be true, false or never, got {msg.early_stopping!r}")
    return BeamSearchParams(
        beam_width=msg.beam_width, max_tokens=msg.max_tokens or 16, length_penalty=msg.length_penalty,
        ignore_eos=msg.ignore_eos, early_stopping=_EARLY_STOPPING[msg.early_stopping],
    )


def request_params(request) -> SamplingParams:
    """The SamplingParams of a Reserve / Prefill / Generate request."""
    return sampling_from_proto(request.params, request.HasField("params"))


def images_to_proto(images: Sequence[ImageInput]) -> list[pb.ImageInput]:
    return [pb.ImageInput(offset=im.offset, length=im.length, data=im.data) for im in images]


def images_from_proto(images) -> tuple[ImageInput, ...]:
    """A request's images (the engine hashes their bytes; it checks their positions)."""
    return tuple(ImageInput(offset=im.offset, length=im.length, data=bytes(im.data)) for im in images)


def prompt_ids(ids: Sequence[int]) -> list[int]:
    return [int(t) for t in ids]


def check_token_ids(name: str, ids: Sequence[int]) -> None:
    """Token ids arrive as int32: a negative one is a client bug worth naming before the engine sees it."""
    bad = [t for t in ids if t < 0 or t > _INT32_MAX]
    if bad:
        raise ValueError(f"{name}: negative token ids {bad[:8]}")


# ------------------------------------------------------------------------------------- small records


def logprobs_to_proto(lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=top)


def logprobs_from_proto(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def prompt_logprobs_to_proto(plp: Sequence[TokenLogprobs | None] | None) -> list[pb.TokenLogprobs]:
    """Prompt tokens 1.. (token 0 has no context, so no entry on the wire)."""
    return [] if not plp else [logprobs_to_proto(lp) for lp in plp[1:]]


def prompt_logprobs_from_proto(msgs) -> tuple[TokenLogprobs | None, ...] | None:
    return (None, *(logprobs_from_proto(m) for m in msgs)) if len(msgs) else None


def layout_to_proto(layout: KVLayout | None) -> pb.KVLayout | None:
    return None if layout is None else pb.KVLayout(**layout.to_dict())


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(
        model_id=msg.model_id, dtype=msg.dtype, block_size=msg.block_size, num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads, head_size=msg.head_size, num_blocks=msg.num_blocks,
    )


def load_to_proto(load: NodeLoad) -> pb.Load:
    return pb.Load(
        num_waiting=load.num_waiting, num_running=load.num_running, num_reserved=load.num_reserved,
        num_held=load.num_held, queued_prefill_tokens=load.queued_prefill_tokens,
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=load.total_kv_blocks, kv_cache_usage=load.kv_cache_usage,
        lora_adapters=load.lora_adapters, lora_capacity=load.lora_capacity, lora_resident=load.lora_resident,
        lora_paths=load.lora_paths,
    )


def load_from_proto(msg: pb.Load) -> NodeLoad:
    return NodeLoad(
        num_waiting=msg.num_waiting, num_running=msg.num_running, num_reserved=msg.num_reserved,
        num_held=msg.num_held, queued_prefill_tokens=msg.queued_prefill_tokens, free_kv_blocks=msg.free_kv_blocks,
        total_kv_blocks=msg.total_kv_blocks, kv_cache_usage=msg.kv_cache_usage,
        lora_adapters=tuple(msg.lora_adapters), lora_capacity=msg.lora_capacity,
        lora_resident=tuple(msg.lora_resident), lora_paths=tuple(msg.lora_paths),
    )


# --------------------------------------------------------------------------------------- RPC replies


def node_info_to_proto(info: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=info.node_id, role=info.role, model_id=info.model_id, block_size=info.block_size, dtype=info.dtype,
        max_model_len=info.max_model_len, vocab_size=info.vocab_size, capacity_tokens=info.capacity_tokens,
        layout=layout_to_proto(info.layout), connector=info.connector, kv_address=info.kv_address,
        grpc_address=info.grpc_address, metrics_address=info.metrics_address, lora_adapters=info.lora_adapters,
        max_loras=info.max_loras, max_lora_rank=info.max_lora_rank, lora_capacity=info.lora_capacity,
    )


def node_info_from_proto(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        node_id=msg.node_id, role=msg.role, model_id=msg.model_id, block_size=msg.block_size,
        max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, capacity_tokens=msg.capacity_tokens,
        connector=msg.connector, kv_address=msg.kv_address, grpc_address=msg.grpc_address,
        metrics_address=msg.metrics_address, dtype=msg.dtype,
        layout=layout_from_proto(msg.layout) if msg.HasField("layout") else None,
        lora_adapters=tuple(msg.lora_adapters), max_loras=msg.max_loras, max_lora_rank=msg.max_lora_rank,
        lora_capacity=msg.lora_capacity,
    )


def reserve_result_to_proto(r: ReserveResult) -> pb.ReserveResponse:
    return pb.ReserveResponse(
        request_id=r.request_id, node_id=r.node_id, kv_address=r.kv_address, num_cached_tokens=r.num_cached_tokens,
        dst_block_ids=list(r.dst_block_ids), layout=layout_to_proto(r.layout),
        lease_expires_unix_ms=r.lease_expires_unix_ms, transfer_id=r.transfer_id,
    )


def reserve_result_from_proto(msg: pb.ReserveResponse) -> ReserveResult:
    return ReserveResult(
        request_id=msg.request_id, node_id=msg.node_id, kv_address=msg.kv_address,
        num_cached_tokens=msg.num_cached_tokens, dst_block_ids=tuple(msg.dst_block_ids),
        layout=layout_from_proto(msg.layout) if msg.HasField("layout") else None,
        lease_expires_unix_ms=msg.lease_expires_unix_ms, transfer_id=msg.transfer_id,
    )


def prefill_result_to_proto(request_id: str, r: PrefillResult) -> pb.PrefillResponse:
    msg = pb.PrefillResponse(
        request_id=request_id, first_token_id=r.first_token_id, num_cached_tokens=r.num_cached_tokens,
        bytes_transferred=r.bytes_transferred, transfer_seconds=r.transfer_seconds,
        prefill_seconds=r.prefill_seconds, finish_reason=r.finish_reason, last_layer_seconds=r.last_layer_seconds,
        prompt_logprobs=prompt_logprobs_to_proto(r.prompt_logprobs),
    )
    if r.first_logprobs is not None:
        msg.first_logprobs.CopyFrom(logprobs_to_proto(r.first_logprobs))
    return msg


def prefill_result_from_proto(msg: pb.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        first_token_id=msg.first_token_id,
        first_logprobs=logprobs_from_proto(msg.first_logprobs) if msg.HasField("first_logprobs") else None,
        num_cached_tokens=msg.num_cached_tokens, bytes_transferred=msg.bytes_transferred,
        transfer_seconds=msg.transfer_seconds, prefill_seconds=msg.prefill_seconds,
        finish_reason=msg.finish_reason, last_layer_seconds=msg.last_layer_seconds,
        prompt_logprobs=prompt_logprobs_from_proto(msg.prompt_logprobs),
    )


def handoff_to_proto(result: PrefillResult) -> pb.Handoff:
    return pb.Handoff(first_token_id=result.first_token_id, first_logprobs=logprobs_to_proto(result.first_logprobs))


def beam_to_proto(beam: BeamSequence) -> pb.BeamSequence:
    msg = pb.BeamSequence(token_ids=list(beam.token_ids), cumulative_logprob=beam.cumulative_logprob,
                          score=beam.score, finish_reason=beam.finish_reason)
    if beam.stop_reason is not None:
        msg.stop_reason = beam.stop_reason
    return msg


def beam_from_proto(msg: pb.BeamSequence) -> BeamSequence:
    return BeamSequence(tuple(msg.token_ids), msg.cumulative_logprob, msg.score, msg.finish_reason,
                        msg.stop_reason if msg.HasField("stop_reason") else None)


def chunk_to_proto(chunk: TokenChunk) -> pb.TokenChunk:
    msg = pb.TokenChunk(
        token_ids=list(chunk.token_ids), finish_reason=chunk.finish_reason,
        num_prompt_tokens=chunk.num_prompt_tokens, num_output_tokens=chunk.num_output_tokens,
        num_cached_tokens=chunk.num_cached_tokens, prompt_logprobs=prompt_logprobs_to_proto(chunk.prompt_logprobs),
        beams=[beam_to_proto(b) for b in chunk.beams], embedding=list(chunk.embedding),
    )
    if chunk.logprobs:
        msg.logprobs.extend(logprobs_to_proto(lp) for lp in chunk.logprobs)
    if chunk.stop_reason is not None:
        msg.stop_reason = chunk.stop_reason
    return msg


def chunk_from_proto(msg: pb.TokenChunk) -> TokenChunk:
    return TokenChunk(
        token_ids=tuple(msg.token_ids), logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason, stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None,
        num_prompt_tokens=msg.num_prompt_tokens, num_output_tokens=msg.num_output_tokens,
        num_cached_tokens=msg.num_cached_tokens, prompt_logprobs=prompt_logprobs_from_proto(msg.prompt_logprobs),
        beams=tuple(beam_from_proto(b) for b in msg.beams), embedding=tuple(msg.embedding),
    )
