"""The engine's side of an IndexPublisher, for the publisher's own tests.

On a node, the engine thread submits block events after each step and answers the publisher's snapshot
requests between steps, so a snapshot never falls halfway through a change. `EngineSide` plays that part
with a lock: a test changes its cache and submits the events inside `step()`, and a thread answers
snapshot requests with `snapshot_fn()` outside of steps. (The real engine thread is covered by the node tests.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from kvrelay.index import IndexPublisher


class EngineSide:
    def __init__(self, publisher: IndexPublisher, snapshot_fn: Callable[[], Iterable[bytes]]) -> None:
        self.publisher = publisher
        self.snapshot_fn = snapshot_fn
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, name="engine-side", daemon=True)
        self._thread.start()

    @contextmanager
    def step(self):
        """One engine step: change the cache and submit its events; no snapshot is taken meanwhile."""
        with self._lock:
            yield self.publisher

    def _answer(self) -> None:
        while not self._stop.wait(0.001):
            with self._lock:
                if self.publisher.snapshot_wanted:
                    self.publisher.submit_snapshot(list(self.snapshot_fn()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def __enter__(self) -> EngineSide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
