"""Waiting queues: first-come-first-served, or by (priority, arrival)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque

from shared.config import SchedulingPolicy
from shared.engine.request import Request


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


class PriorityQueue(RequestQueue):
    """Lower priority value first, then earlier arrival. Removal is lazy (O(1) abort)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # By identity, not id: a removed request's stale heap entry must not come back to life when a new
        # request reuses its id.
        self._live: dict[str, Request] = {}
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._seq), req))
        self._live[req.request_id] = req

    add_front = add  # the (priority, arrival) key already puts a preempted request where it belongs

    def _prune(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].request_id) is not self._heap[0][3]:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._prune()
        req = heapq.heappop(self._heap)[3]
        del self._live[req.request_id]
        return req

    def remove(self, req: Request) -> None:
        if self._live.get(req.request_id) is req:
            del self._live[req.request_id]

    def __len__(self) -> int:
        return len(self._live)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FCFSQueue()
