"""A simulated fleet: nodes, gateways, the registry and the index stream on one simulated clock.

- Nodes register in the in-memory registry (kvrelay.index.memory, on the simulated clock) when their start-up
  time is over, and renew their lease with their load every heartbeat, as a node's Heartbeat does.
- Gateways read the registry every refresh interval into their Discovery (the published load lags by up to a
  heartbeat plus a refresh, as in production), and route with their Router; a load balancer sends arrivals to
  the gateways in turn. A gateway restart drains the old instance and starts a new one `restart_s` later with
  empty routing state and its mirror loaded from a snapshot of the index.
- A node's block events go to the index stream after each step; each gateway's mirror follows it.
- A controller (the planner's autoscaler) may be called every `control_s` to add or drain nodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvrelay.engine.config import SchedulerConfig
from kvrelay.gateway.config import GatewayConfig
from kvrelay.index.memory import MemoryRegistry, MemoryStore
from kvrelay.node.config import SERVING_ENGINE, RegistryConfig
from kvrelay.sim.dispatch import Dispatcher, SimRequest
from kvrelay.sim.events import EventLoop
from kvrelay.sim.gateway import IndexStream, SimGateway
from kvrelay.sim.node import SimNode
from kvrelay.sim.tier import SimTier
from kvrelay.sim.timemodel import Profile
from kvrelay.sim.trace import PromptSource, TraceRequest

MODEL_ID = "sim-model"


@dataclass(frozen=True)
class FleetSpec:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    gateways: int = 1
    policy: str = "precise"
    threads: int | None = None  # CPU threads per node (a calibrated profile has a step model per count)
    scheduler: SchedulerConfig = SERVING_ENGINE.scheduler  # what `kvrelay prefill/decode` run with
    kv_blocks: int | None = None  # per node; None: the profile's
    max_model_len: int | None = None  # None: what the KV cache holds
    local_prefill_threshold: int = GatewayConfig.local_prefill_threshold
    max_concurrent_requests: int = GatewayConfig.max_concurrent_requests
    queue_timeout_s: float = GatewayConfig.queue_timeout
    capacity_wait_s: float = GatewayConfig.capacity_wait
    heartbeat_s: float = RegistryConfig.heartbeat_s
    lease_ttl_s: float = RegistryConfig.ttl_s
    refresh_s: float = GatewayConfig.refresh_interval
    index_delay_s: float = 0.006  # block event -> visible in the gateways' mirrors (publisher batch + stream read)
    hop_s: float = 0.0005  # one gateway <-> node call
    restarts: tuple[tuple[float, int], ...] = ()  # (time, gateway number): restart that gateway then
    restart_s: float = 5.0  # a restarted gateway serves again this long after it stopped taking requests
    odd_block_size_nodes: int = 0  # nodes started with another block size (the gateways must refuse them)
    offload_blocks: int = 0  # per node: an offload tier in its host's memory (kvrelay.sim.tier); 0: none
    offload_bytes_per_s: float = 25e9  # loading from it: a GPU's host-to-device link (PCIe 5 x16, in practice)
    tier_routing: bool = True  # the tiers publish to the index and routing weighs them (False: as if it could not)

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("a fleet is colocated nodes, or prefill and decode nodes, not both")
        if not (self.colocated or self.decode):
            raise ValueError("a fleet needs decode or colocated nodes")
        if self.gateways < 1:
            raise ValueError("gateways: at least 1")


@dataclass
class Timeline:
    """What a controller and the report read over time."""

    nodes: list[tuple[float, int, int]] = field(default_factory=list)  # (time, prefill+colocated, decode) serving


class Fleet:
    def __init__(self, spec: FleetSpec, profile: Profile, seed: int = 0) -> None:
        self.spec, self.profile, self.seed = spec, profile, seed
        self.loop = EventLoop()
        self.block_size = profile.block_size
        self.num_blocks = spec.kv_blocks or profile.kv_cache_blocks
        self.max_model_len = spec.max_model_len or self.num_blocks * self.block_size
        self.step_model = profile.step_model(spec.threads)
        self.registry = MemoryRegistry(MemoryStore(clock=self.loop.clock))
        self.stream = IndexStream(spec.index_delay_s)
        self.dispatcher = Dispatcher(self)
        self.nodes: dict[str, SimNode] = {}
        self._serving: dict[str, SimNode] = {}  # registered (started, not draining)
        self._next_heartbeat: dict[str, float] = {}
        self._ids = {role: itertools.count() for role in ("prefill", "decode", "colocated")}
        self.gateways: list[SimGateway] = []
        self._gateway_ids = itertools.count()
        self._lb = itertools.count()
        self.retired: list[SimNode] = []
        self.timeline = Timeline()
        self.controller: Callable[[Fleet], None] | None = None
        self.control_s = 0.0
        self.active = True
        for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("colocated", spec.colocated)):
            for _ in range(n):
                self.add_node(role, startup_s=0.0)
        for _ in range(spec.odd_block_size_nodes):
            self.add_node("colocated" if spec.colocated else "decode", startup_s=0.0, block_size=self.block_size * 2)
        for _ in range(spec.gateways):
            self.gateways.append(self._new_gateway())
        for at, g in spec.restarts:
            self.loop.at(at, self.restart_gateway, g)

    # -- nodes --------------------------------------------------------------------------------------------

    def add_node(self, role: str, startup_s: float | None = None, block_size: int | None = None) -> SimNode:
        """A node that starts now and serves (registers) `startup_s` later (None: the profile's start-up)."""
        node_id = f"{role}-{next(self._ids[role]):03d}"
        entry_id = f"tier:memory:{node_id}" if self.spec.tier_routing else ""
        tier = (SimTier(self.spec.offload_blocks, self.profile.kv_bytes_per_block, self.spec.offload_bytes_per_s,
                        entry_id) if self.spec.offload_blocks else None)
        node = SimNode(node_id, role, self.loop, self.dispatcher, self.step_model, self.spec.scheduler,
                       self.num_blocks, block_size or self.block_size, MODEL_ID, self.max_model_len, tier)
        self.nodes[node_id] = node
        delay = self.profile.startup_s if startup_s is None else startup_s
        if delay <= 0:
            self._register(node)
        else:
            self.loop.after(delay, self._register, node)
        return node

    def _register(self, node: SimNode) -> None:
        if node.draining:
            return
        self._serving[node.node_id] = node
        self.registry.register(node.registration(), self.spec.lease_ttl_s, node.load())
        # Heartbeats of different nodes fall at different phases, as independent processes' do.
        phase = (len(self._next_heartbeat) * 0.618) % 1.0 * self.spec.heartbeat_s
        self._next_heartbeat[node.node_id] = self.loop.now + phase

    def drain_node(self, node_id: str) -> None:
        """Take a node out of rotation now (deregistered); it finishes what it holds, then is gone."""
        node = self.nodes[node_id]
        node.draining = True
        if node_id in self._serving:
            del self._serving[node_id]
            self._next_heartbeat.pop(node_id, None)
            self.registry.deregister(node_id, MODEL_ID)
            for entry_id, hashes in node.index_holdings().items():  # its host's tier goes with it
                self.stream.forget_node(entry_id, hashes, self.loop.now)
        self._retire_if_idle(node)

    def _retire_if_idle(self, node: SimNode) -> None:
        if node.draining and node.idle and node.node_id in self.nodes:
            del self.nodes[node.node_id]
            node.retired_at = self.loop.now
            self.retired.append(node)

    def serving(self, role: str) -> list[SimNode]:
        return [n for n in self._serving.values() if n.role == role]

    def starting(self, role: str) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.role == role and not n.draining and n.node_id not in self._serving]

    # -- gateways -----------------------------------------------------------------------------------------

    def _new_gateway(self) -> SimGateway:
        i = next(self._gateway_ids)
        gw = SimGateway(f"gateway-{i}", self.spec.policy, self.seed * 1000 + i, MODEL_ID, self.block_size,
                        self.spec.local_prefill_threshold, self.stream)
        gw.load_snapshot({k: v for n in self._serving.values() for k, v in n.index_holdings().items()})
        gw.refresh(self.registry.live_nodes(MODEL_ID))
        return gw

    def restart_gateway(self, g: int) -> None:
        old = self.gateways[g]
        old.accepting = False  # it drains what it serves; the others take the arrivals meanwhile
        self.loop.after(self.spec.restart_s, self._replace_gateway, g)

    def _replace_gateway(self, g: int) -> None:
        self.gateways[g] = self._new_gateway()

    def pick_gateway(self) -> SimGateway | None:
        live = [g for g in self.gateways if g.accepting]
        return live[next(self._lb) % len(live)] if live else None

    # -- the index ----------------------------------------------------------------------------------------

    def publish(self, node: SimNode, events: list, entry_id: str | None = None) -> None:
        if node.node_id in self._serving:
            self.stream.publish(self.loop.now, entry_id or node.node_id, events)

    def cached_anywhere(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Prompt tokens some node held when the request was routed (the prefix the best node could reuse)."""
        if not hashes:
            return 0
        held = self.stream.oracle.lookup(hashes)
        best = max(held.values(), default=0) * self.block_size
        return min(best, num_tokens - 1)

    def transfer_s(self, num_blocks: int, step_s: float) -> float:
        """When a transfer of these blocks ends after the step that computed them: the layers went out as they
        were computed, so what remains is the last layer's share, or whatever the link could not keep up with."""
        t = self.profile.transfer
        wire = num_blocks * self.profile.kv_bytes_per_block / (
            t.same_host_bytes_per_s if self.profile.single_host else t.network_bytes_per_s)
        layers = self.profile.model.num_layers
        return t.per_request_s + max(wire / layers, wire - step_s * (layers - 1) / layers)

    # -- time ---------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Heartbeats that are due, then every gateway's registry read; again in refresh_s while active."""
        now = self.loop.now
        for node_id, due in self._next_heartbeat.items():
            if due <= now:
                node = self._serving[node_id]
                self.registry.register(node.registration(), self.spec.lease_ttl_s, node.load())
                self._next_heartbeat[node_id] = due + self.spec.heartbeat_s
        rows = self.registry.live_nodes(MODEL_ID)
        for gw in self.gateways:
            gw.refresh(rows)
        self.stream.trim([gw.cursor for gw in self.gateways if gw.mirror is not None])
        for node in list(self.nodes.values()):
            self._retire_if_idle(node)
        if self.active:
            self.loop.after(self.spec.refresh_s, self.tick)

    def control(self) -> None:
        if self.controller is not None:
            self.controller(self)
        self.timeline.nodes.append((self.loop.now, len(self.serving("prefill")) + len(self.serving("colocated")),
                                    len(self.serving("decode"))))
        if self.active:
            self.loop.after(self.control_s, self.control)

    def start(self, trace: Sequence[TraceRequest], source: PromptSource, on_done: Callable[[SimRequest], None]
              ) -> None:
        """Play the trace: each request is built (its tokens) when it arrives, and forgotten when it ends."""
        pending = len(trace)

        def done(req: SimRequest) -> None:
            nonlocal pending
            pending -= 1
            on_done(req)
            if not pending:
                self.active = False

        self.dispatcher.on_done = done
        self._trace, self._source = trace, source
        if trace:
            self.loop.at(trace[0].arrival_s, self._arrive, 0)
        else:
            self.active = False
        self.loop.at(0.0, self.tick)
        if self.control_s > 0:
            self.loop.at(0.0, self.control)

    def _arrive(self, i: int) -> None:
        trace = self._trace
        if i + 1 < len(trace):
            self.loop.at(trace[i + 1].arrival_s, self._arrive, i + 1)
        t = trace[i]
        req = SimRequest(i, self._source.prompt(i, t), self._source.output_tokens(i, t), self.loop.now,
                         t.session, t.tenant or t.prefix_group)
        if self.step_model.request_overhead_s:  # the served path's own time (timemodel), before routing
            self.loop.after(self.step_model.request_overhead_s, self._enter, req)
        else:
            self._enter(req)

    def _enter(self, req: SimRequest) -> None:
        gw = self.pick_gateway()
        if gw is None:  # every gateway restarting: the client retries shortly
            self.loop.after(0.1, self._enter, req)
            return
        self.dispatcher.arrive(req, gw)
