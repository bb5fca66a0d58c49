"""The simulator's clock and event queue: one heap of (time, sequence, callback), run in order. Events due at
the same time run in the order they were scheduled, so a run is a pure function of its inputs and seed."""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.num_events = 0

    def clock(self) -> float:
        """The simulated time (what production classes get instead of time.monotonic)."""
        return self.now

    def at(self, t: float, fn: Callable, *args) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is in the past (now {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        self.at(self.now + delay_s, fn, *args)

    def run(self, until: float | None = None) -> None:
        """Run events in order until none is left (or the next is past `until`)."""
        heap, pop = self._heap, heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, _, fn, args = pop(heap)
            self.now = t
            self.num_events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)
