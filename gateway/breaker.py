"""Circuit breaking per node: which nodes the gateway stops sending work to, and when it tries them again.

One failed call is no proof that a node is down (a transfer between two healthy nodes can fail, a busy node
can be slow), and ejecting on it turns every hiccup into lost capacity; but a dead node must not cost every
request that is routed to it either. So a node's breaker

1. starts CLOSED (routable). It opens after `failure_threshold` consecutive failed calls, or when at least
   `min_calls` calls in the last `window_s` failed at `error_rate` or more, or at once on evidence: a direct
   health probe that went unanswered.
2. OPEN: not routable for `open_s`, doubling while it keeps failing (up to `max_open_s`).
3. When the period is over the discovery's health probe decides: answered, it becomes HALF_OPEN (routable
   again); unanswered, it stays OPEN for the next, longer period.
4. HALF_OPEN: the first successful call closes it; the first failure opens it again.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3  # consecutive failed calls
    error_rate: float = 0.5  # ... or this share of the calls in the window
    min_calls: int = 10  # (the rate counts once the window holds this many)
    window_s: float = 10.0
    open_s: float = 1.0  # first open period; doubles while the node keeps failing
    max_open_s: float = 30.0


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self._calls: deque[tuple[float, bool]] = deque()  # (time, ok) within the window
        self.open_until = 0.0
        self._open_s = self.config.open_s
        self.reason = ""

    @property
    def routable(self) -> bool:
        return self.state != BreakerState.OPEN

    def probe_due(self, now: float | None = None) -> bool:
        """OPEN and its period over: a health probe decides what comes next."""
        now = time.monotonic() if now is None else now
        return self.state == BreakerState.OPEN and now >= self.open_until

    def record_success(self, now: float | None = None) -> bool:
        """Returns True when this changed the state (HALF_OPEN -> CLOSED)."""
        self._record(True, now)
        self.consecutive = 0
        if self.state == BreakerState.HALF_OPEN:
            self.state, self._open_s, self.reason = BreakerState.CLOSED, self.config.open_s, ""
            return True
        return False

    def record_failure(self, reason: str, now: float | None = None) -> bool:
        """Returns True when this opened the breaker."""
        now = time.monotonic() if now is None else now
        self._record(False, now)
        self.consecutive += 1
        if self.state == BreakerState.OPEN:
            return False
        c = self.config
        failed = sum(1 for _, ok in self._calls if not ok)
        by_rate = len(self._calls) >= c.min_calls and failed >= c.error_rate * len(self._calls)
        if self.state == BreakerState.HALF_OPEN or self.consecutive >= c.failure_threshold or by_rate:
            self.trip(reason, now)
            return True
        return False

    def trip(self, reason: str, now: float | None = None) -> None:
        """Open now (evidence: the node did not answer a health probe)."""
        now = time.monotonic() if now is None else now
        if self.state != BreakerState.CLOSED:
            self._open_s = min(self._open_s * 2, self.config.max_open_s)  # failed again: wait longer
        self.state, self.open_until, self.reason = BreakerState.OPEN, now + self._open_s, reason

    def probe_passed(self) -> bool:
        """A health probe answered: OPEN -> HALF_OPEN. Returns True when the state changed."""
        if self.state != BreakerState.OPEN:
            return False
        self.state = BreakerState.HALF_OPEN
        return True

    def _record(self, ok: bool, now: float | None) -> None:
        now = time.monotonic() if now is None else now
        self._calls.append((now, ok))
        horizon = now - self.config.window_s
        while self._calls and self._calls[0][0] < horizon:
            self._calls.popleft()
