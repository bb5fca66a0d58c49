"""Hand-over of keyed requests between gateways: what a gateway publishes about a keyed request it runs, and how
a request's generation learns that it continues one that another gateway started.

A keyed request (gateway.idempotency) with Redis runs as a KeyedRun:
- Its sequence asks its node to keep it (EngineRequest.keep_s), so that the node goes on generating when this
  gateway dies.
- Each time a node's stream of it starts (after the hand-off, or after a move), the Placement goes to Redis
  (`publish`, in the background: one write per node, none per token).
- A gateway that receives the same key and body, and holds no copy itself, reads the record. Its generation then
  resumes the sequence where the record says it runs (`resume`), instead of computing it again.

A record covers one sequence: a request with n > 1 or a beam search is not handed over, because its choices
interleave by arrival time, so a second gateway could not repeat its events in the same order.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from kvrelay.common import wire
from kvrelay.gateway.sequence_state import Placement
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb


@dataclass(frozen=True)
class RunRecord:
    """A keyed request as Redis holds it while it runs: its request id (so that the events another gateway
    sends carry the same `id`) and where its sequence is."""

    request_id: str
    placement: Placement


@dataclass(frozen=True)
class KeyedRun:
    keep_s: float  # how long the node keeps the sequence once no gateway follows it
    resume: RunRecord | None  # set: go on with this record's sequence instead of starting one
    exact: bool  # the client has part of the output already (a stream resumed after an event)
    publish: Callable[[RunRecord], None]  # where the sequence runs now (to Redis, in the background)


keyed_run: ContextVar[KeyedRun | None] = ContextVar("kvrelay_keyed_run", default=None)


def record_to_json(record: RunRecord) -> bytes:
    p = record.placement
    prefix = [base64.b64encode(wire.chunk_to_proto(c).SerializeToString()).decode() for c in p.prefix]
    return json.dumps({"id": record.request_id, "address": p.address, "node": p.node_id, "seq": p.request_id,
                       "prefix": prefix, "skip_first": p.skip_first, "moves": p.moves, "extended": p.extended,
                       "prefill": p.prefill_node_id}).encode()


def record_from_json(raw: bytes) -> RunRecord:
    """The record; ValueError (KeyError, TypeError) if it is not one."""
    d = json.loads(raw)
    prefix = tuple(wire.chunk_from_proto(pb.TokenChunk.FromString(base64.b64decode(c))) for c in d["prefix"])
    placement = Placement(str(d["address"]), str(d["node"]), str(d["seq"]), prefix, bool(d["skip_first"]),
                          int(d["moves"]), bool(d["extended"]), d["prefill"])
    return RunRecord(str(d["id"]), placement)
