"""The registry lease's heartbeat: a thread that renews a node's registration with its current load.

Heartbeat lifecycle:
1. `start()` spawns the thread; every `interval_s` (ttl/3 by default) it re-registers the node with fresh
   load from `load_fn`.
2. A renewal that finds its lease lapsed (a long pause, a Redis restart) calls `on_lapse`, so the node's
   publisher resyncs whatever the janitor may have purged meanwhile.
3. Every `janitor_every` beats it purges the index entries of nodes whose lease lapsed.
4. `stop()` ends the thread; failures in between are logged and retried, never raised.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from kvrelay.common.records import NodeLoad
from kvrelay.index.base import IndexUnavailable, NodeRegistration, RegistryBackend

log = logging.getLogger(__name__)


class Heartbeat:
    """Renews a registration every ttl/3 with the node's current load, and runs the janitor every
    `janitor_every` beats. Failures are logged and retried at the next beat; they never raise."""

    def __init__(
        self,
        registry: RegistryBackend,
        reg: NodeRegistration,
        ttl_s: float,
        load_fn: Callable[[], NodeLoad] | None = None,
        *,
        on_lapse: Callable[[], None] | None = None,
        janitor_every: int = 3,
        interval_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self.registry = registry
        self.reg = reg
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else ttl_s / 3
        self.load_fn = load_fn
        self.on_lapse = on_lapse
        self.janitor_every = max(1, janitor_every)
        self.num_beats = 0
        self.num_failures = 0
        self.num_lapses = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{reg.node_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _load(self) -> NodeLoad | None:
        if self.load_fn is None:
            return None
        try:
            load = self.load_fn()
        except Exception:  # a broken load probe must not stop the lease
            log.exception("load_fn of %s failed", self.reg.node_id)
            return None
        return load if load.ts else dataclasses.replace(load, ts=time.time())

    def beat(self) -> None:
        """One renewal (+ janitor when due). Public so tests and shutdown paths can force one."""
        try:
            existed = self.registry.register(self.reg, self.ttl_s, self._load())
            self.num_beats += 1
            if not existed:
                self._lapsed()
            if self.num_beats % self.janitor_every == 0:
                self.registry.purge_dead_nodes(self.reg.model_id)
        except IndexUnavailable as exc:
            self.num_failures += 1
            if self.num_failures == 1 or self.num_failures % 20 == 0:
                log.warning("heartbeat of %s failed (%d so far): %s", self.reg.node_id, self.num_failures, exc)

    def _lapsed(self) -> None:
        self.num_lapses += 1
        log.warning("lease of %s had lapsed; re-registered", self.reg.node_id)
        if self.on_lapse is not None:
            try:
                self.on_lapse()
            except Exception:
                log.exception("on_lapse of %s failed", self.reg.node_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
