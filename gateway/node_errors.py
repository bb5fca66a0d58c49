"""How a failed engine call reads in the gateway (NodeRpcError), and the handle the liveness monitor holds on a
call in flight (CallWatch)."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvrelay.common import wire

_BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}
_BAD_INPUT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class NodeRpcError(Exception):
    """A failed engine call. `kind` is what the node itself said went wrong (kvrelay.common.wire.NodeErrorKind), or
    None when the call failed without the node answering (down, hung, unreachable)."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str,
                 kind: str | None = None) -> None:
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.address, self.method, self.code, self.details, self.kind = address, method, code, details, kind

    @classmethod
    def from_grpc(cls, address: str, method: str, e: grpc.aio.AioRpcError) -> NodeRpcError:
        try:
            kind = dict(e.trailing_metadata() or ()).get(wire.NODE_ERROR_KEY)
        except (TypeError, ValueError):
            kind = None
        return cls(address, method, e.code(), e.details() or "", kind)

    @property
    def busy(self) -> bool:
        """Refused for capacity: the node is fine, its queues are full."""
        return self.code in _BUSY

    @property
    def bad_input(self) -> bool:
        return self.code in _BAD_INPUT

    @property
    def duplicate(self) -> bool:
        """The node still holds a sequence under this id: it must not run it twice."""
        return self.code == grpc.StatusCode.ALREADY_EXISTS

    @property
    def missing(self) -> bool:
        """The node does not hold what the call named (a LoRA adapter): another node may."""
        return self.code == grpc.StatusCode.NOT_FOUND

    @property
    def draining(self) -> bool:
        return self.kind == wire.NodeErrorKind.DRAINING.value

    @property
    def handoff_failed(self) -> bool:
        """The node answered that the KV transfer with its peer failed (the node itself is fine)."""
        return self.kind == wire.NodeErrorKind.HANDOFF.value

    @property
    def answered(self) -> bool:
        """The node's own code returned this error: the node is alive."""
        return self.kind is not None


class CallWatch:
    """One call in flight on one node, as the liveness monitor sees it: when it last heard from the node,
    and a way to fail the call from outside (the node stopped answering)."""

    __slots__ = ("node_id", "last", "heard", "call", "error")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.last = time.monotonic()  # since when the call has waited without news (output, or a probe's answer)
        self.heard: float | None = None  # when the node itself last sent something on this call
        self.call = None
        self.error: str | None = None

    def touch(self) -> None:
        self.last = time.monotonic()

    def output(self) -> None:
        """The node sent something on this call."""
        self.last = self.heard = time.monotonic()

    def fail(self, reason: str) -> None:
        self.error = reason
        if self.call is not None:
            self.call.cancel()

    def raise_if_failed(self, address: str, method: str) -> None:
        """Inside `except CancelledError`: the watch cancelled the call (not the caller's own task)."""
        if self.error is not None and not asyncio.current_task().cancelling():
            raise NodeRpcError(address, method, grpc.StatusCode.UNAVAILABLE, self.error) from None
