"""How the dispatcher (gateway.dispatch) judges a failed call and counts what happened on each hop.

A call that failed before any output either ends the request (bad input, past its deadline) or moves it on to
the next node; only a node that failed for a reason of its own (not busy, draining, a duplicate id, a missing
adapter) counts against its breaker. A stream that failed mid-way becomes a NodeFailure, which the dispatcher
answers with a move. When every node of a role refused, the error says why in the client's terms: 429 when
they were at their queue bound, 503 when none had room in time.
"""

from __future__ import annotations

from kvrelay.gateway.discovery import Discovery, Node
from kvrelay.gateway.errors import BadRequest, ModelNotFound, NoCapacity, NodeFailure, Overloaded, RequestTimeout
from kvrelay.gateway.node_client import EngineRequest, NodeRpcError


class Outcomes:
    """`metrics`: the gateway's (None: nothing counted); `queue_timeout_s`: how long a reservation may queue."""

    def __init__(self, discovery: Discovery, metrics, queue_timeout_s: float) -> None:
        self.discovery = discovery
        self.metrics = metrics
        self.queue_timeout_s = queue_timeout_s

    def hop_failed(self, node: Node, e: NodeRpcError, req: EngineRequest, hop: str) -> None:
        """A call before any output failed: raise if the request cannot go on, else note it and move on."""
        if e.bad_input and not e.method.endswith("LoRAAdapter"):
            raise BadRequest.from_value_error(ValueError(e.details)) from None
        if req.expired():
            raise self.timeout() from None
        self.count_retry(hop)
        if e.busy or e.duplicate or e.draining or e.missing or e.method.endswith("LoRAAdapter"):
            if e.busy:
                self.count("reservation_refusals")
            return  # the node is fine; it just cannot take this one
        self.node_failed(node, e)

    def stream_failed(self, node: Node, e: NodeRpcError, req: EngineRequest) -> Exception:
        if req.expired():
            return self.timeout()
        if not e.draining:
            self.node_failed(node, e)
        return NodeFailure(f"decode node {node.node_id} failed mid-stream: {e.details or e.code.name}",
                           node_id=node.node_id)

    def exhausted(self, role: str, refused: int, timed_out: int, last: NodeRpcError | None) -> Exception:
        if refused:
            return Overloaded(f"every {role} node that could take the request is at its queue bound "
                              f"({refused} refused); retry later")
        if timed_out:
            return NoCapacity(f"no {role} node had room for the request within "
                              f"{self.queue_timeout_s:g}s; retry later")
        if last is not None and last.missing:
            return ModelNotFound(last.details, param="model")
        detail = f": {last.details or last.code.name}" if last is not None else ""
        return NodeFailure(f"no {role} node could take the request{detail}")

    def node_failed(self, node: Node, e: NodeRpcError) -> None:
        self.discovery.record_failure(node, e, answered=e.answered)
        if self.metrics is not None:
            self.metrics.node_failures.labels(node.node_id).inc()

    def timeout(self) -> RequestTimeout:
        if self.metrics is not None:
            self.metrics.request_timeouts.inc()
        return RequestTimeout("the request passed its deadline (--request-timeout) and was aborted")

    def observe(self, local: bool, num_prompt: int, num_cached: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_mode(local)
            self.metrics.observe_prefix(num_prompt, num_cached)

    def count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def count_retry(self, hop: str) -> None:
        if self.metrics is not None:
            self.metrics.retries.labels(hop).inc()
