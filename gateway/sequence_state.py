"""What the dispatcher (dispatch.py) keeps of one sequence while it runs: the nodes that may hold its state (to
abort them however it ends), its attempts across node failures (what the client has received, the next
attempt's request), where it runs now (a Placement, for another gateway to attach to), and its place in the
router's and the metrics' in-flight counts on a node."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.discovery import Node
from kvrelay.gateway.errors import NodeFailure
from kvrelay.gateway.node_client import EngineRequest


@dataclass(frozen=True)
class Placement:
    """Where a sequence's tokens come from now, and what its client got before: what another gateway needs to
    go on with it should this one die. The node keeps the sequence (EngineRequest.keep_s) and streams it again
    from its first chunk on Attach."""

    address: str  # the node's gRPC address
    node_id: str
    request_id: str  # the node's id of the sequence
    prefix: tuple[TokenChunk, ...]  # what the client got before this node's stream, as the dispatcher yielded it
    skip_first: bool  # the node's stream begins with the handed-off token, which is already in the prefix
    moves: int  # the sequence's moves so far (the next attempt's id counts on from here)
    extended: bool  # the node's prompt carries earlier output
    prefill_node_id: str | None = None  # who computed the prompt (None: the decode node itself)


@dataclass
class Holders:
    """Nodes that may hold state for the sequence right now (to abort on an early exit). `on_placed(node,
    request_id, skip_first)`: told when a node's token stream of the sequence is about to start."""

    nodes: dict[str, tuple[Node, str]]
    trace: dict
    on_placed: Callable[[Node, str, bool], None] | None = None

    def placed(self, node: Node, request_id: str, skip_first: bool) -> None:
        if self.on_placed is not None:
            self.on_placed(node, request_id, skip_first)

    def add(self, node: Node, request_id: str) -> None:
        self.nodes[node.node_id] = (node, request_id)

    def remove(self, node: Node) -> None:
        self.nodes.pop(node.node_id, None)


class SequenceAttempts:
    """One engine sequence across its attempts: what the client has received, where it failed."""

    def __init__(self, req: EngineRequest, trace: dict, keep_chunks: bool = False) -> None:
        """`keep_chunks`: keep what was yielded, for a Placement's prefix (a keyed request's)."""
        self.original = self.current = req
        self.trace = trace
        self.generated: list[int] = []
        self.keep_chunks = keep_chunks
        self.chunks: list[TokenChunk] = []
        self.failed: set[str] = set()
        self.moves = 0
        self.extended = False  # the current prompt carries earlier output
        # What first interrupted it: if no move succeeds, the client learns this (e.g. node_stopped), not
        # the error of a recovery attempt (a connection refused by the node that just stopped).
        self.cause: NodeFailure | None = None

    def observe(self, chunk: TokenChunk) -> TokenChunk:
        self.generated.extend(chunk.token_ids)
        if self.extended:  # its cache hit counted the earlier output too: the first attempt's figure stands
            chunk = replace(chunk, num_cached_tokens=0)
        if self.keep_chunks:
            self.chunks.append(chunk)
        return chunk

    def resume(self, place: Placement) -> None:
        """Go on from where another gateway left the sequence: its client got `place.prefix`, and the node it
        names streams the rest."""
        self.chunks = list(place.prefix)
        self.generated = [t for chunk in place.prefix for t in chunk.token_ids]
        self.moves, self.extended = place.moves, place.extended
        self.current = replace(self.original, request_id=place.request_id)

    def placement(self, node: Node, request_id: str, skip_first: bool) -> Placement:
        return Placement(node.address, node.node_id, request_id, tuple(self.chunks), skip_first, self.moves,
                         self.extended, self.trace.get("prefill") if skip_first else None)

    def move(self, failure: NodeFailure) -> None:
        """The next attempt's request: the prompt plus what was streamed, under a new id."""
        self.moves += 1
        self.cause = self.cause or failure
        if failure.node_id:
            self.failed.add(failure.node_id)
        orig, k = self.original, len(self.generated)
        params = replace(orig.params, num_resumed_tokens=orig.params.num_resumed_tokens + k) if k else orig.params
        self.extended = k > 0
        self.current = EngineRequest(f"{orig.request_id}.m{self.moves}", [*orig.prompt_token_ids, *self.generated],
                                     params, orig.cache_salt, beam_search=orig.beam_search,
                                     deadline=orig.deadline, lora_name=orig.lora_name, span=orig.span,
                                     images=orig.images)


class Tracked:
    """A sequence on a node: the router's in-flight count and the per-node gauge."""

    __slots__ = ("count", "metrics", "node")

    def __init__(self, count, metrics, node: Node) -> None:
        self.count, self.metrics, self.node = count, metrics, node

    def __enter__(self) -> Tracked:
        self.count.__enter__()
        if self.metrics is not None:
            self.metrics.node_inflight(self.node.node_id, self.node.role, 1)
        return self

    def __exit__(self, *exc) -> None:
        self.count.__exit__()
        if self.metrics is not None:
            self.metrics.node_inflight(self.node.node_id, self.node.role, -1)
