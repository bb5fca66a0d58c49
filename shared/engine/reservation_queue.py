"""Decode role: reservations waiting for KV blocks, first come first served.

A burst of requests must wait for blocks, not fail: a Reserve that finds the cache full queues here (when
its caller allows waiting) instead of being refused.

Lifecycle:
1. `Scheduler.reserve` queues a reservation that does not fit now (or that others are already waiting
   ahead of), with the time until which its caller waits.
2. After every engine iteration the head is retried while the free-block count has moved since its last
   failed try; each that fits gets its blocks and a lease, in arrival order (nothing overtakes the head).
3. A reservation still queued at its deadline is dropped and its caller told "no room".
4. An abort takes it out of the queue; nothing was allocated for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvrelay.engine.request import Request


class QueueFull(RuntimeError):
    """The node's waiting requests are at --max-waiting-requests: refuse rather than queue without bound."""


class DuplicateRequest(ValueError):
    """The request id is already in use on this engine (a retry must not run twice on one node)."""


@dataclass
class QueuedReservation:
    req: Request
    lease_s: float
    until: float  # monotonic: give up waiting at this time


class ReservationQueue:
    def __init__(self) -> None:
        self._items: dict[str, QueuedReservation] = {}  # insertion order is arrival order
        self.free_blocks_at_last_try = -1  # the head is retried only once this changes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[QueuedReservation]:
        return iter(list(self._items.values()))

    def add(self, item: QueuedReservation) -> None:
        self._items[item.req.request_id] = item
        self.free_blocks_at_last_try = -1

    def remove(self, request_id: str) -> QueuedReservation | None:
        return self._items.pop(request_id, None)

    def expire(self, now: float) -> list[str]:
        expired = [rid for rid, q in self._items.items() if q.until <= now]
        for rid in expired:
            del self._items[rid]
        return expired

    def ids(self) -> list[str]:
        return list(self._items)
