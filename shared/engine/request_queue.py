"""Waiting queues: first-come-first-served, by (priority, arrival), or shortest prompt first with aging."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator

from kvrelay.engine.config import SchedulerConfig, SchedulingPolicy
from kvrelay.engine.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, req: Request) -> None: ...

    @abstractmethod
    def add_front(self, req: Request) -> None:
        """Return a preempted request: it goes ahead of requests that arrived after it."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests, in no particular order."""


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class KeyedQueue(RequestQueue):
    """Smallest key first, ties by insertion. A key is fixed when a request is added. Removal is lazy (O(1)
    abort)."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self._key = key
        self._heap: list[tuple[tuple, int, Request]] = []
        # By identity, not id: a removed request's stale heap entry must not come back to life when a new
        # request reuses its id.
        self._live: dict[str, Request] = {}
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (self._key(req), next(self._seq), req))
        self._live[req.request_id] = req

    add_front = add  # a key from the arrival already puts a preempted request where it belongs

    def _prune(self) -> None:
        while self._heap and self._live.get(self._heap[0][2].request_id) is not self._heap[0][2]:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._prune()
        req = heapq.heappop(self._heap)[2]
        del self._live[req.request_id]
        return req

    def remove(self, req: Request) -> None:
        if self._live.get(req.request_id) is req:
            del self._live[req.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._live.values())


def by_priority(req: Request) -> tuple:
    """Lower priority value first, then earlier arrival."""
    return req.priority, req.arrival_time


def shortest_first(tokens_per_s: float) -> Callable[[Request], tuple]:
    """Lower priority value first; among equals, fewest prompt tokens first, each second of waiting worth
    `tokens_per_s` tokens.

    A burst is prefilled shortest first: most of it gets its first token while the long prompts are still
    computing, instead of every request waiting for the ones that happened to arrive before it (its effect on
    TTFT: docs/results/2026-11-25-zen5/NOTES.md). The aging bounds the cost to long prompts: a request
    arriving t seconds later passes this one only if it is shorter by more than t * tokens_per_s, so none
    waits behind later arrivals for longer than prompt_len / tokens_per_s.

    The priority (0 unless a request sets it) is what makes the gateway's tenants fair at the nodes: it gives each
    request its tenant's count of requests already in flight (gateway.core), so a tenant's backlog waits behind
    other tenants' new requests instead of ahead of them.
    """
    def key(req: Request) -> tuple:
        return (req.priority, req.num_prompt_tokens + tokens_per_s * req.arrival_time)
    return key


def create_request_queue(config: SchedulerConfig) -> RequestQueue:
    if config.policy == SchedulingPolicy.PRIORITY:
        return KeyedQueue(by_priority)
    if config.policy == SchedulingPolicy.SJF:
        return KeyedQueue(shortest_first(config.sjf_tokens_per_s))
    return FCFSQueue()
