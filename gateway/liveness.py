"""Notice a node that stopped answering while calls wait on it: a hung process (SIGSTOP, a stuck host) keeps
its TCP connections open, so its streams would simply go quiet until gRPC's keepalive gave up.

Lifecycle:
1. Every call that may wait long on a node (a queued Reserve, a Prefill, a token stream) runs under a
   `CallWatch` from `watch(node)`; the stream marks it each time a chunk arrives.
2. Every `interval_s` the monitor looks at each node with watched calls: if none of them heard from the
   node for `stall_s`, or the node is no longer known to discovery, it probes the node's Health.
3. No answer within the probe timeout: the node's breaker opens (discovery.trip) and every watched call on
   it fails with NodeRpcError, which the dispatcher answers by moving the request to another node.
   An answer: the calls were just slow (a long queue, a big prefill); their clocks restart.
4. A call leaves the monitor when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvrelay.gateway.discovery import Discovery, Node
from kvrelay.gateway.node_client import CallWatch, NodeClients, NodeRpcError

logger = logging.getLogger(__name__)


class Liveness:
    def __init__(self, discovery: Discovery, clients: NodeClients, stall_s: float = 5.0, probe_timeout_s: float = 2.0,
                 interval_s: float = 0.5) -> None:
        self.discovery = discovery
        self.clients = clients
        self.stall_s = stall_s
        self.probe_timeout_s = probe_timeout_s
        self.interval_s = interval_s
        self._watches: dict[str, set[CallWatch]] = {}
        self._nodes: dict[str, Node] = {}
        self._probing: set[str] = set()
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._background) if t is not None]
        self._task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @contextmanager
    def watch(self, node: Node) -> Iterator[CallWatch]:
        w = CallWatch(node.node_id)
        self._nodes[node.node_id] = node
        self._watches.setdefault(node.node_id, set()).add(w)
        try:
            yield w
        finally:
            left = self._watches.get(node.node_id)
            if left is not None:
                left.discard(w)
                if not left:
                    del self._watches[node.node_id]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # the monitor must outlive a bad round
                logger.exception("liveness check failed")

    def check(self, now: float | None = None) -> None:
        """One round: probe the nodes whose watched calls went quiet (or that discovery no longer lists)."""
        now = time.monotonic() if now is None else now
        known = {n.node_id for n in self.discovery.nodes()}
        for node_id, watches in list(self._watches.items()):
            if not watches or node_id in self._probing:
                continue
            quiet = now - max(w.last for w in watches)
            if quiet >= self.stall_s or node_id not in known:
                self._probing.add(node_id)
                task = asyncio.ensure_future(self._probe(self._nodes[node_id], quiet))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _probe(self, node: Node, quiet: float) -> None:
        try:
            health = await self.clients.get(node.address).health(timeout=self.probe_timeout_s)
            reason = None if health.healthy else f"unhealthy: {health.message}"
        except NodeRpcError as e:
            reason = f"no answer to a health probe after {quiet:.1f}s without output ({e.code.name})"
        finally:
            self._probing.discard(node.node_id)
        watches = list(self._watches.get(node.node_id, ()))
        if reason is None:
            for w in watches:
                w.touch()  # alive, just slow: wait another stall period
            return
        logger.warning("node %s stopped answering (%s); failing its %d calls in flight", node.node_id, reason,
                       len(watches))
        self.discovery.trip(node.node_id, reason)
        for w in watches:
            w.fail(f"node {node.node_id} stopped answering: {reason}")
