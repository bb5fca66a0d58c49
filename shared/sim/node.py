"""A simulated node: the production scheduler, KV cache manager and block pool (prefix cache and its block
events included), with the forward pass replaced by a step-time model.

Each step is the engine's own: `Scheduler.schedule()` decides, the step model says how long the forward pass
of that shape takes on the profile's hardware, and at its end `update_from_output` takes one sampled token per
request that reached the end of its known tokens (what `EngineCore.step` does around the model runner). The
node then hands its outputs, the KV transfers its step started, and its pool's STORED/EVICTED events to the
fleet, and steps again while it has work. Time is the simulator's clock (kvrelay.sim.events); nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from kvrelay.common.records import NodeLoad
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.kv_handoff import KVHandoff
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import EngineCoreOutput, KVSend, ModelRunnerOutput, SchedulerOutput
from kvrelay.index.base import NodeRegistration
from kvrelay.sim.events import EventLoop
from kvrelay.sim.tier import SimTier
from kvrelay.sim.timemodel import LinearStep, RooflineStep, StepShape


class NodeListener(Protocol):
    """What a node tells the fleet after each step (the simulator's Dispatcher)."""

    def on_step(self, node: SimNode, outputs: list[EngineCoreOutput], sends: tuple[KVSend, ...],
                expired: list[str]) -> None: ...

    def on_block_events(self, node: SimNode, events: list, entry_id: str | None = None) -> None:
        """The node's prefix-cache events (`entry_id` None), or its offload tier's, for that index entry."""


@dataclass
class NodeStats:
    steps: int = 0
    busy_s: float = 0.0
    tokens: int = 0  # computed (prefill and decode)
    prefill_tokens: int = 0


class SimNode:
    """`role`: "prefill", "decode", or "colocated" (registered as a decode node on the `local` connector: it
    prefills everything it serves itself)."""

    def __init__(self, node_id: str, role: str, loop: EventLoop, listener: NodeListener,
                 step_model: LinearStep | RooflineStep, scheduler_config: SchedulerConfig, num_blocks: int,
                 block_size: int, model_id: str, max_model_len: int, tier: SimTier | None = None) -> None:
        self.node_id, self.role = node_id, role
        self.loop, self.listener, self.step_model = loop, listener, step_model
        self.block_size, self.model_id = block_size, model_id
        self.tier = tier
        if tier is not None:  # what the node publishes a loaded token to cost, against a 512-token prompt step
            self._tier_token_cost = tier.token_cost(block_size, step_model.time(StepShape.of([(512, 0)])) / 512)
        self.pool = BlockPool(num_blocks, enable_caching=True, record_events=True,
                              on_evict=tier.offload if tier is not None else None)
        self.kv = KVCacheManager(self.pool, block_size, model_id, enable_caching=True, tier=tier)
        self.handoff = KVHandoff(self.kv, clock=loop.clock)
        self.scheduler = Scheduler(scheduler_config, self.kv, max_model_len, None, self.handoff)
        # What the simulated model answers, by request id: token i of a request's output is answers[rid][i]
        # (set by whoever adds the request, dropped when it ends).
        self.answers: dict[str, list[int]] = {}
        self.stats = NodeStats()
        self.stepping = False
        self.draining = False
        self.last_step_s = 0.0
        self.started_at = loop.now
        self.retired_at: float | None = None

    def registration(self) -> NodeRegistration:
        role = "decode" if self.role == "colocated" else self.role
        connector = "local" if self.role == "colocated" else "auto"
        return NodeRegistration(node_id=self.node_id, role=role, grpc_address=f"sim://{self.node_id}",
                                kv_address=f"sim://{self.node_id}/kv", connector=connector, model_id=self.model_id,
                                block_size=self.block_size, dtype="simulated",
                                capacity_tokens=self.pool.num_blocks * self.block_size,
                                kv_tiers=(self.tier.entry_id,) if self.tier is not None and self.tier.entry_id else ())

    def load(self) -> NodeLoad:
        """What its heartbeat publishes: the scheduler's load, and with a tier what a loaded token costs."""
        load = self.scheduler.load()
        return load if self.tier is None else replace(load, kv_tier_token_cost=self._tier_token_cost)

    @property
    def idle(self) -> bool:
        """Holds nothing: no request, reservation, queued reservation or held blocks."""
        return not self.scheduler.requests and not len(self.handoff.queued) and not self.handoff.held

    def wake(self) -> None:
        """Something was queued: step (at this instant, after whatever else happens now)."""
        if not self.stepping:
            self.stepping = True
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        expired: list[str] = []
        if self.handoff.has_leases():
            expired = self.scheduler.expire_leases()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.stepping = False
            if expired:
                self.listener.on_step(self, [], (), expired)
            return
        # One pass over the step: its shape (tokens, and the context each chunk starts from), and what the
        # model samples at its end for the requests that reach the end of their known tokens.
        reqs, answers = self.scheduler.requests, self.answers
        chunks: list[tuple[int, int]] = []
        sampled: dict[str, tuple[int]] = {}
        for rid, n in sched.num_scheduled_tokens.items():
            req = reqs[rid]
            done = req.num_computed_tokens  # schedule() counted this step's tokens already
            chunks.append((n, done - n))
            if done >= len(req.all_token_ids):
                sampled[rid] = (answers[rid][len(req.output_token_ids)],)
        shape = StepShape.of(chunks)
        dt = self.step_model.time(shape)
        if self.tier is not None:  # the blocks its admissions loaded, before the forward
            dt += self.tier.take_load_s()
        self.last_step_s = dt
        stats = self.stats
        stats.steps += 1
        stats.busy_s += dt
        stats.tokens += shape.tokens
        stats.prefill_tokens += shape.prefill_tokens
        self.loop.at(self.loop.now + dt, self._finish, sched, sampled, expired)

    def _finish(self, sched: SchedulerOutput, sampled: dict[str, tuple[int]], expired: list[str]) -> None:
        # A request aborted meanwhile is gone from the scheduler, which then skips its sample.
        outputs = self.scheduler.update_from_output(sched, ModelRunnerOutput(sampled_token_ids=sampled))
        self.listener.on_step(self, outputs, sched.kv_sends, expired)
        self.flush_events()
        self._step()

    def flush_events(self) -> None:
        """Hand the pool's STORED/EVICTED events to the fleet (after a step, a reservation, a hand-off)."""
        events = self.pool.drain_events()
        if events:
            self.listener.on_block_events(self, events)
        if self.tier is not None:
            events = self.tier.drain_events()
            if events:
                self.listener.on_block_events(self, events, self.tier.entry_id)

    def index_holdings(self) -> dict[str, list[bytes]]:
        """Its entries in the index: its own and its tier's."""
        out = {self.node_id: list(self.pool.cached)}
        if self.tier is not None and self.tier.entry_id:
            out[self.tier.entry_id] = self.tier.hashes()
        return out
