"""What the planner recommends an autoscaler do: per-pod targets from the profile and the SLOs, and a schedule.

A reactive autoscaler cannot meet a burst that lasts less than a node takes to start (75 s on the GPU
profiles, plus HPA syncs): it must hold the burst's room all the time, over whatever its metrics say now, and on
a day of one-minute bursts at 2.5x that costs more than a fleet sized once for the peak (docs/fleet.md). A
diurnal day repeats, so the planner learns from the trace (yesterday) when the room is needed:

- the day's base rate: a rolling median of the per-minute arrival rate over `smooth_s`, which a burst shorter than
  half of it does not move;
- the burst factor: the q-th percentile over the day of the minute rate over that base;
- the peak-sized pool of N nodes was shown (by the search) to serve the busiest minute of the busiest window, R;
  so at time t the pool needs N x factor x base / R nodes, taken as the most over the next `lead_s` (start-up
  plus two syncs) so that nodes serve when the need comes, at most N.

This becomes a `Schedule` (KEDA cron triggers in the overlay), and the reactive targets stay at what one node
serves within the SLOs: the metrics answer load the schedule did not foresee, the queue-time signal first.
Without a schedule (`scheduled=False`), the targets are divided by the burst headroom instead (a reactive-only
HPA that holds the room itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvrelay.sim.autoscale import HPAPolicy, PoolPolicy, Schedule
from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.results import RunResult
from kvrelay.sim.timemodel import Profile, StepShape
from kvrelay.sim.trace import TraceRequest

SLOTS_PER_DAY = 48  # half-hour cron windows when the trace is taken as one day


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float
    itl_p90_s: float

    def met(self, r: RunResult) -> bool:
        return (r.failed == 0 and r.ttft_p90_s is not None and r.ttft_p90_s <= self.ttft_p90_s
                and r.itl_p90_s is not None and r.itl_p90_s <= self.itl_p90_s)


def prefill_tokens_per_s(profile: Profile, budget: int, threads: int | None = None) -> float:
    """What one node computes of prompts per second, chunk after chunk of `budget` tokens."""
    step = profile.step_model(threads).time(StepShape.of([(budget, budget)]))
    return budget / step


def rows_for_itl(profile: Profile, itl_s: float, context: int, threads: int | None = None, limit: int = 1024) -> int:
    """The largest decode batch whose step stays within itl_s at this context."""
    model = profile.step_model(threads)
    rows = 1
    while rows < limit and model.time(StepShape.of([(1, context)] * (rows + 1))) <= itl_s:
        rows += 1
    return rows


def arrivals_per_s(trace: Sequence[TraceRequest], period_s: int | None = None) -> np.ndarray:
    end = period_s or (int(trace[-1].arrival_s) + 1 if trace else 1)
    counts = np.bincount(np.array([int(r.arrival_s) for r in trace if r.arrival_s < end], dtype=np.int64),
                         minlength=end)
    return counts[:end].astype(np.float64)


def minute_rates(per_s: np.ndarray) -> np.ndarray:
    """The arrival rate over the minute centred on each second."""
    return np.convolve(per_s, np.ones(60) / 60, mode="same")


def busiest_minute(trace: Sequence[TraceRequest]) -> float:
    return float(minute_rates(arrivals_per_s(trace)).max()) if trace else 0.0


def base_rates(minute: np.ndarray, smooth_s: int) -> np.ndarray:
    """The rolling median of the minute rates over `smooth_s` centred on each second."""
    half = smooth_s // 2
    padded = np.pad(minute, half, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
    return np.median(windows, axis=1)


def burst_headroom(trace: Sequence[TraceRequest], react_s: float, history_s: float = 300.0, q: float = 99.0) -> float:
    """How much more than its recent average the load can get before new nodes serve: the q-th percentile over
    the trace of (the busiest minute in the next `react_s`) / (the mean rate of the last `history_s`). An
    autoscaler that cannot add nodes in time for a burst, and knows nothing of the day ahead, must hold this
    much room."""
    if len(trace) < 2:
        return 1.0
    per_s = arrivals_per_s(trace)
    end = len(per_s)
    minute = np.convolve(per_s, np.ones(60) / 60, mode="full")[: end]  # rate over the minute ending at t
    cum = np.concatenate([[0.0], np.cumsum(per_s)])
    ratios = []
    for t in range(int(history_s), end - 1):
        past = (cum[t] - cum[t - int(history_s)]) / history_s
        ahead = minute[t: min(end, t + int(react_s) + 60)].max()
        if past > 0:
            ratios.append(ahead / past)
    return max(1.0, float(np.percentile(ratios, q))) if ratios else 1.0


def needed_rps(trace: Sequence[TraceRequest], lead_s: float, smooth_s: int = 300, q: float = 99.0) -> np.ndarray:
    """Per second of the trace's period (its span in whole minutes): the rate to hold room for, the base rate's
    most over the next `lead_s` times the burst factor (see the module's docstring)."""
    period = max(60, math.ceil((trace[-1].arrival_s if trace else 0.0) / 60) * 60)
    minute = minute_rates(arrivals_per_s(trace, period))
    base = base_rates(minute, smooth_s)
    busy = base > 0
    factor = max(1.0, float(np.percentile(minute[busy] / base[busy], q))) if busy.any() else 1.0
    lead = int(math.ceil(lead_s))
    ahead = np.concatenate([base, base])[: period + lead]  # the period repeats: the next morning follows the evening
    return np.lib.stride_tricks.sliding_window_view(ahead, lead + 1).max(axis=1) * factor


def schedule_for(need_rps: np.ndarray, pool_size: int, served_rps: float, slots: int = SLOTS_PER_DAY) -> Schedule:
    """Replicas per slot of the period for a pool whose `pool_size` nodes serve `served_rps`."""
    period = len(need_rps)
    per_second = np.minimum(pool_size, np.maximum(1, np.ceil(pool_size * need_rps / max(served_rps, 1e-9) - 1e-9)))
    bounds = np.linspace(0, period, slots + 1)
    steps: list[tuple[float, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        replicas = int(per_second[int(a): max(int(a) + 1, int(math.ceil(b)))].max())
        if not steps or steps[-1][1] != replicas:
            steps.append((float(a), replicas))
    return Schedule(float(period), tuple(steps))


def hpa_policy(spec: FleetSpec, profile: Profile, slo: SLO, trace: Sequence[TraceRequest], max_factor: float = 2.0,
               use_queue_signal: bool = True, sync_s: float = 15.0, scheduled: bool = False,
               window: Sequence[TraceRequest] | None = None) -> HPAPolicy:
    """The autoscalers for the chosen shape: per-pod targets at which a node still meets
    the SLOs, up to max_factor times the static shape's pools. `scheduled`: each pool also gets the schedule
    learned from `trace`, given that the static pools serve the busiest minute of `window` (the searched
    window); else the targets are divided by the trace's burst headroom."""
    lead_s = profile.startup_s + 2 * sync_s
    headroom = 1.0 if scheduled else burst_headroom(trace, lead_s)
    budget = spec.scheduler.max_num_batched_tokens
    queued = prefill_tokens_per_s(profile, budget, spec.threads) * slo.ttft_p90_s / 2
    context = sum(r.prompt_len + r.output_len / 2 for r in trace) / max(len(trace), 1)
    running = rows_for_itl(profile, 0.8 * slo.itl_p90_s, int(context), spec.threads)
    prefill_targets = {"kvrelay:queued_prefill_tokens": max(1, round(queued / headroom))}
    decode_targets = {"vllm:num_requests_running": max(1, math.floor(running / headroom)),
                      "vllm:kv_cache_usage_perc": round(0.85 / headroom, 3)}
    if scheduled:  # one demand curve for every pool
        need, served = needed_rps(trace, lead_s), busiest_minute(window if window is not None else trace)

    def pool(size: int, targets: dict[str, float]) -> PoolPolicy:
        if not scheduled:
            return PoolPolicy(1, math.ceil(size * max_factor), targets)
        # The schedule steps down when the day does; the window only damps the metrics' own noise.
        return PoolPolicy(1, math.ceil(size * max_factor), targets, schedule=schedule_for(need, size, served),
                          down_window_s=4 * sync_s)

    if spec.colocated:
        pools = {"colocated": pool(spec.colocated, {**prefill_targets, **decode_targets})}
    else:
        pools = {"prefill": pool(spec.prefill, prefill_targets), "decode": pool(spec.decode, decode_targets)}
    return HPAPolicy(pools, sync_s=sync_s, use_queue_signal=use_queue_signal)
