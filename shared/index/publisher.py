"""Publishes a node's block events to the index from a thread off the engine's hot path.

Lifecycle:
1. The engine thread calls `submit(events)` after each step: an append under a lock that only ever guards
   the queue, so it never waits on Redis.
2. The publisher thread batches (up to `max_batch` events, or whatever arrived within `flush_interval_s` of
   the first) and applies each batch in order with one round trip (`BlockIndex.apply`).
3. Resync. When the index may have diverged from the engine (a failed write whose effect is unknown, a
   Redis restart, a lapsed lease whose entries the janitor purged, a backlog past `max_backlog`), the
   publisher drops its queue and raises `snapshot_wanted`. The engine thread answers, between two steps,
   with `submit_snapshot(hashes)`: every hash its cache holds at that moment, queued like any event batch.
   The publisher clears the node and republishes the snapshot, then the events that came after it: the
   order on one queue makes the index end equal to the engine's cache, and the publisher never calls back
   into the engine (the engine owns its cache; the publisher only listens).
4. `close()` flushes what is queued (giving up on a failure or the timeout) and stops the thread.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.index.base import BlockIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Snapshot:
    hashes: Sequence[bytes]


class IndexPublisher:
    def __init__(
        self,
        index: BlockIndex,
        node_id: str,
        *,
        max_batch: int = 256,
        flush_interval_s: float = 0.005,
        max_backlog: int = 100_000,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        clear_on_start: bool = True,
        start: bool = True,
    ) -> None:
        if max_batch < 1 or max_backlog < max_batch:
            raise ValueError(f"need 1 <= max_batch <= max_backlog, got {max_batch}, {max_backlog}")
        self.index = index
        self.node_id = node_id
        self.max_batch = max_batch
        self.flush_interval_s = flush_interval_s
        self.max_backlog = max_backlog
        self.backoff_s = backoff_s
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Sequence[BlockEvent] | _Snapshot] = collections.deque()
        self._backlog = 0  # events in _queue
        self._resync = clear_on_start
        self._want_snapshot = False  # raised by a resync, lowered by submit_snapshot
        self._busy = False  # a batch or resync is being applied
        self._closing = False
        # apply() reports an unknown node on the first write after a clear: expected then, a purge otherwise.
        self._fresh_expected = True
        self.num_batches = 0
        self.num_events = 0
        self.num_resyncs = 0
        self.num_errors = 0
        self.num_dropped = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"index-publisher-{node_id}", daemon=True)
        if start:
            self._thread.start()

    # ---------------------------------------------------------------- engine side

    def submit(self, events: Sequence[BlockEvent]) -> None:
        """Queue events in the order they happened. O(1); never blocks on the index."""
        if not events:
            return
        with self._cond:
            if self._closing or self._want_snapshot:  # a snapshot is coming that already reflects them
                return
            self._queue.append(events)
            self._backlog += len(events)
            if self._backlog > self.max_backlog:
                # The index is unreachable or too slow: a snapshot is cheaper than an unbounded queue.
                self.num_dropped += self._backlog
                self._drop_queue()
                self._resync = True
            self._cond.notify_all()

    @property
    def snapshot_wanted(self) -> bool:
        """True while a resync waits for the engine's snapshot (read on the engine thread, lock-free)."""
        return self._want_snapshot

    def submit_snapshot(self, hashes: Sequence[bytes]) -> None:
        """Every hash the engine's cache holds now; it supersedes everything queued before it."""
        with self._cond:
            if self._closing:
                return
            self._want_snapshot = False
            self._drop_queue()
            self._queue.append(_Snapshot(list(hashes)))
            self._cond.notify_all()

    def request_resync(self) -> None:
        """Clear the node's entries and republish the snapshot (e.g. after the node's lease lapsed)."""
        with self._cond:
            self._resync = True
            self._cond.notify_all()

    @property
    def backlog(self) -> int:
        return self._backlog

    def start(self) -> None:
        self._thread.start()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything submitted so far is in the index. False on timeout (index down)."""
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._idle(), timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued (gives up after a failure or the timeout), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> IndexPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- publisher thread

    def _idle(self) -> bool:
        return not self._queue and not self._busy and not self._resync and not self._want_snapshot

    def _drop_queue(self) -> None:
        self._queue.clear()
        self._backlog = 0

    def _take(self, n: int) -> list[BlockEvent]:
        batch: list[BlockEvent] = []
        while self._queue and len(batch) < n and not isinstance(self._queue[0], _Snapshot):
            chunk = self._queue.popleft()
            room = n - len(batch)
            if len(chunk) > room:
                self._queue.appendleft(chunk[room:])
                chunk = chunk[:room]
            batch.extend(chunk)
        self._backlog -= len(batch)
        return batch

    def _next_job(self) -> tuple[str, list[BlockEvent]] | None:
        """Under the lock: wait for work, linger to fill a batch, and claim it. None: time to exit."""
        self._cond.wait_for(lambda: self._closing or self._resync or self._queue)
        if self._resync:
            self._resync = False
            self._drop_queue()  # whatever was queued is superseded by the snapshot to come
            self._want_snapshot = True
            return self._next_job()
        if self._queue and isinstance(self._queue[0], _Snapshot):
            self._busy = True
            return "snapshot", list(self._queue.popleft().hashes)
        if not self._queue:
            return None  # closing and drained
        if self._backlog < self.max_batch and not self._closing:
            self._cond.wait_for(
                lambda: self._backlog >= self.max_batch or self._closing or self._resync, self.flush_interval_s
            )
            if self._resync or (self._queue and isinstance(self._queue[0], _Snapshot)):
                return self._next_job()
        self._busy = True
        return "batch", self._take(self.max_batch)

    def _run(self) -> None:
        delay = self.backoff_s[0]
        while True:
            with self._cond:
                job = self._next_job()
            if job is None:
                return
            kind, batch = job
            failed = False
            try:
                if kind == "snapshot":
                    self._republish(batch)
                else:
                    self._apply(batch)
                delay = self.backoff_s[0]
            except Exception as exc:  # whatever the index raises, the engine must never see it
                failed = True
                self._failed(exc, len(batch))
            with self._cond:
                self._busy = False
                if failed:
                    self._resync = True
                self._cond.notify_all()
                if failed:
                    if self._closing:
                        log.warning("index publisher %s closing with the index unreachable", self.node_id)
                        return
                    self._cond.wait_for(lambda: self._closing, delay)
                    delay = min(delay * 2, self.backoff_s[1])

    def _failed(self, exc: Exception, num_events: int) -> None:
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        # Rate-limited: Redis down means one failure per backoff step.
        if self.num_errors == 1 or self.num_errors % 20 == 0:
            log.warning(
                "index publisher %s: write failed (%d failures; %d events will be resynced): %s",
                self.node_id,
                self.num_errors,
                num_events,
                self.last_error,
            )

    def _apply(self, batch: list[BlockEvent]) -> None:
        fresh = self.index.apply(self.node_id, batch)
        self.num_batches += 1
        self.num_events += len(batch)
        if fresh and not self._fresh_expected:
            log.warning("index entries of %s were purged; resyncing", self.node_id)
            with self._cond:
                self._resync = True
        self._fresh_expected = False

    def _republish(self, hashes: list[bytes]) -> None:
        self.index.clear_node(self.node_id)
        self._fresh_expected = True
        stored = BlockEventKind.STORED
        step = self.max_batch * 4
        for i in range(0, len(hashes), step):
            self._apply([BlockEvent(stored, h) for h in hashes[i : i + step]])
        self.num_resyncs += 1
        log.info("index publisher %s: resynced %d blocks", self.node_id, len(hashes))
