"""Autoscaling in the simulator: the HorizontalPodAutoscalers of deploy/k8s, on the metrics they scale on there.

Every `sync_s` (the HPA controller's sync period) each pool's desired size is, per metric, ceil(ready pods x
average / target), the largest over its metrics; bounded by min/max replicas and by the behaviour policies
(scale up at most `up_pods` per `up_period_s`, down at most `down_pods` per `down_period_s`, down only to the
largest size desired over the last `down_window_s`: the stabilization window). A new pod serves after the
profile's start-up time; a removed one drains. The metrics are the nodes' own, read from their schedulers:

- prefill (and colocated) pools: `kvrelay:queued_prefill_tokens` per pod. Prompt tokens queued at a node divided
  by what the node computes per second is the time a new prompt waits there: the queue-time signal, which rises
  the moment a burst arrives, before any throughput or utilisation figure moves;
- decode pools: `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` per pod.

`use_queue_signal=False` drops the queue-time metric (a planner that sizes on throughput and utilisation only:
the comparison of docs/fleet.md).

A pool may also have a `Schedule`: replicas by time of day, as KEDA's cron triggers give them (the planner writes
a KEDA ScaledObject then). The desired size is the larger of the schedule's and the metrics': the schedule holds
the room for bursts that come faster than a node starts, the metrics answer what the schedule did not foresee.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from kvrelay.sim.fleet import Fleet


@dataclass(frozen=True)
class Schedule:
    """Replicas by time within a repeating period (a day): `steps` are (start offset, replicas), the first at 0."""

    period_s: float
    steps: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        if not self.steps or self.steps[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(self.steps, self.steps[1:])):
            raise ValueError("schedule steps: increasing start offsets from 0")
        if self.steps[-1][0] >= self.period_s:
            raise ValueError("schedule steps: start offsets within the period")

    def replicas_at(self, t: float) -> int:
        return self.steps[bisect.bisect_right(self.steps, t % self.period_s, key=lambda step: step[0]) - 1][1]


@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int
    max_replicas: int
    targets: dict[str, float]  # metric name -> target average per pod
    schedule: Schedule | None = None
    up_pods: int = 4
    up_period_s: float = 60.0
    down_pods: int = 1
    down_period_s: float = 120.0
    down_window_s: float = 300.0


@dataclass(frozen=True)
class HPAPolicy:
    pools: dict[str, PoolPolicy]  # role ("prefill", "decode", "colocated") -> its HPA
    sync_s: float = 15.0
    use_queue_signal: bool = True


def pool_metrics(fleet: Fleet, role: str) -> tuple[int, dict[str, float]]:
    """Ready pods and the per-pod averages of the metrics the HPAs read."""
    nodes = fleet.serving(role)
    if not nodes:
        return 0, {}
    loads = [n.scheduler.load() for n in nodes]
    k = len(nodes)
    return k, {
        "kvrelay:queued_prefill_tokens": sum(load.queued_prefill_tokens for load in loads) / k,
        "vllm:num_requests_waiting": sum(load.num_waiting for load in loads) / k,
        "vllm:num_requests_running": sum(load.num_running for load in loads) / k,
        "vllm:kv_cache_usage_perc": sum(load.kv_cache_usage for load in loads) / k,
    }


@dataclass
class _PoolState:
    desired_history: deque = field(default_factory=deque)  # (time, desired)
    last_up: float = -1e18
    last_down: float = -1e18


class Autoscaler:
    """Installed on a fleet as its controller; `changes` lists (time, role, old size, new size)."""

    def __init__(self, policy: HPAPolicy) -> None:
        self.policy = policy
        self.state = {role: _PoolState() for role in policy.pools}
        self.changes: list[tuple[float, str, int, int]] = []

    def install(self, fleet: Fleet) -> None:
        fleet.controller = self
        fleet.control_s = self.policy.sync_s

    def __call__(self, fleet: Fleet) -> None:
        now = fleet.loop.now
        for role, pool in self.policy.pools.items():
            ready, metrics = pool_metrics(fleet, role)
            current = ready + len(fleet.starting(role))
            desired = current
            if ready:
                wanted = [math.ceil(ready * metrics[name] / target - 1e-9)
                          for name, target in pool.targets.items()
                          if self.policy.use_queue_signal or name != "kvrelay:queued_prefill_tokens"]
                desired = max(wanted, default=current)
            if pool.schedule is not None:
                desired = max(desired, pool.schedule.replicas_at(now))
            desired = max(pool.min_replicas, min(pool.max_replicas, desired))
            self._apply(fleet, role, pool, self.state[role], current, desired, now)

    def _apply(self, fleet: Fleet, role: str, pool: PoolPolicy, st: _PoolState, current: int, desired: int,
               now: float) -> None:
        st.desired_history.append((now, desired))
        while st.desired_history and st.desired_history[0][0] < now - pool.down_window_s:
            st.desired_history.popleft()
        if desired > current:
            if now - st.last_up < pool.up_period_s and st.last_up > -1e17:
                step = 0
            else:
                step = min(desired - current, pool.up_pods)
            for _ in range(step):
                fleet.add_node(role)
            if step:
                st.last_up = now
                self.changes.append((now, role, current, current + step))
        elif desired < current:
            floor = max(d for _, d in st.desired_history)  # the stabilization window
            target = max(floor, current - pool.down_pods)
            if target < current and now - st.last_down >= pool.down_period_s:
                victims = fleet.starting(role)[::-1] + sorted(fleet.serving(role), key=lambda n: n.node_id)[::-1]
                for node in victims[: current - target]:
                    fleet.drain_node(node.node_id)
                st.last_down = now
                self.changes.append((now, role, current, target))


def oscillations(changes: list[tuple[float, str, int, int]], interval_s: float, window: int = 3) -> int:
    """Up-down-up (or down-up-down) sequences of one pool within `window` planner intervals."""
    count = 0
    by_role: dict[str, list[tuple[float, int]]] = {}
    for t, role, old, new in changes:
        by_role.setdefault(role, []).append((t, 1 if new > old else -1))
    for moves in by_role.values():
        for (t1, d1), (_, d2), (t3, d3) in zip(moves, moves[1:], moves[2:]):
            if d1 == d3 == -d2 and t3 - t1 <= window * interval_s:
                count += 1
    return count
