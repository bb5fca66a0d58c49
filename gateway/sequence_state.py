"""What the dispatcher (dispatch.py) keeps of one sequence while it runs: the nodes that may hold its state (to
abort them however it ends), its attempts across node failures (what the client has received, the next
attempt's request), and its place in the router's and the metrics' in-flight counts on a node."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.discovery import Node
from kvrelay.gateway.errors import NodeFailure
from kvrelay.gateway.node_client import EngineRequest


@dataclass
class Holders:
    """Nodes that may hold state for the sequence right now (to abort on an early exit)."""

    nodes: dict[str, tuple[Node, str]]
    trace: dict

    def add(self, node: Node, request_id: str) -> None:
        self.nodes[node.node_id] = (node, request_id)

    def remove(self, node: Node) -> None:
        self.nodes.pop(node.node_id, None)


class SequenceAttempts:
    """One engine sequence across its attempts: what the client has received, where it failed."""

    def __init__(self, req: EngineRequest, trace: dict) -> None:
        self.original = self.current = req
        self.trace = trace
        self.generated: list[int] = []
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
        return chunk

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
