"""Notice a node that stopped answering while calls wait on it: a hung process (SIGSTOP, a stuck host) keeps
its TCP connections open, so its streams would simply go quiet until gRPC's keepalive gave up.

Lifecycle:
1. Every call that may wait long on a node (a queued Reserve, a Prefill, a token stream) runs under a
   `CallWatch` from `watch(node)`; the stream marks it each time a chunk arrives.
2. Every `interval_s` the monitor looks at each node with watched calls: if none of them heard from the
   node for `stall_s`, or the node is no longer known to discovery, it has discovery probe the node's Health
   (the gateway's one prober: one probe per node at a time, within --probe-timeout).
3. Whoever asked for it, a probe's answer reaches the monitor. No answer (or an unhealthy one): discovery has
   opened the node's breaker, and every watched call on the node fails with NodeRpcError, which the dispatcher
   answers by moving the request to another node. An answer: the calls were just slow (a long queue, a big
   prefill); their clocks restart.
   Except a call whose node sent on it within the last round (`interval_s`): its own connection is alive,
   whatever the new connection the probe opened met. A draining node has closed its listener (so the probe
   is refused) while its last messages (the aborts that say "node stopped") are still on their way. Such a
   call stays, and the node is probed again each round until the call ends, goes quiet (then it fails), or
   the node answers.
4. A call leaves the monitor when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.discovery import Discovery, Node, Probe
from kvrelay.gateway.node_client import CallWatch

logger = logging.getLogger(__name__)


class Liveness:
    def __init__(self, discovery: Discovery, stall_s: float = GatewayConfig.stall_timeout,
                 interval_s: float = 0.5) -> None:
        self.discovery, self.stall_s, self.interval_s = discovery, stall_s, interval_s
        self._watches: dict[str, set[CallWatch]] = {}
        self._nodes: dict[str, Node] = {}
        self._doubted: set[str] = set()  # nodes that failed a probe while some of their calls still streamed
        self._task: asyncio.Task | None = None
        discovery.on_probe(self._answered)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

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
                    self._nodes.pop(node.node_id, None)
                    self._doubted.discard(node.node_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # the monitor must outlive a bad round
                logger.exception("liveness check failed")

    def check(self, now: float | None = None) -> None:
        """One round: probe the nodes whose watched calls went quiet, that discovery no longer lists, or that
        failed a probe while some of their calls still streamed."""
        now = time.monotonic() if now is None else now
        known = {n.node_id for n in self.discovery.nodes()}
        for node_id, watches in list(self._watches.items()):
            if not watches:
                continue
            quiet = now - max(w.last for w in watches) >= self.stall_s
            if quiet or node_id not in known or node_id in self._doubted:
                self.discovery.suspect(self._nodes[node_id])

    def _answered(self, node: Node, answer: Probe) -> None:
        """A health probe of `node` ended (this monitor's or another's): its watched calls wait on, or fail."""
        watches = list(self._watches.get(node.node_id, ()))
        if not watches:
            return
        if answer.healthy:
            self._doubted.discard(node.node_id)
            for w in watches:
                w.touch()  # alive, just slow: wait another stall period
            return
        now = time.monotonic()
        streaming = [w for w in watches if w.heard is not None and now - w.heard < self.interval_s]
        if streaming:
            self._doubted.add(node.node_id)
        else:
            self._doubted.discard(node.node_id)
        failing = [w for w in watches if w not in streaming]
        if not failing:
            return
        reason = f"{answer.reason} after {now - max(w.last for w in failing):.1f}s without output"
        logger.warning("node %s stopped answering (%s); failing its %d calls in flight", node.node_id, reason,
                       len(failing))
        for w in failing:
            w.fail(f"node {node.node_id} stopped answering: {reason}")
