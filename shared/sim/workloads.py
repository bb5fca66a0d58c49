"""Trace generators (`kvrelay sim trace ...`): the llm-d shape, multi-turn chat, and a bursty diurnal day.

- llmd: tenants with long shared prefixes (llm-d's precise-prefix benchmark: 150 tenants, 6,000-token shared
  prefixes), Poisson arrivals at one QPS; a sweep is one trace per QPS.
- chat: sessions start as a Poisson process; each turn's prompt is the conversation so far (the previous
  prompt, its answer, a new user message: one group stream per session, trace.py), sent a think time after the
  previous turn.
- day: a compressed day whose rate follows a diurnal curve (trough to peak and back) with bursts on top;
  requests of tenants with shared prefixes, as in llmd but smaller.

Every generator is deterministic for its seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvrelay.sim.trace import TraceRequest


@dataclass(frozen=True)
class Shape:
    """Requests of tenants that share a prefix: lengths in tokens; `spread` draws suffix and output lengths
    uniformly within +-spread of their means (0: fixed)."""

    tenants: int = 150
    prefix_len: int = 6000
    suffix_len: int = 1200
    output_len: int = 1000
    spread: float = 0.0

    def request(self, rng: random.Random, arrival_s: float) -> TraceRequest:
        tenant = f"tenant-{rng.randrange(self.tenants)}"
        return TraceRequest(arrival_s=arrival_s, output_len=max(1, self._draw(rng, self.output_len)),
                            prefix_group=tenant, prefix_len=self.prefix_len,
                            suffix_len=max(1, self._draw(rng, self.suffix_len)), tenant=tenant)

    def _draw(self, rng: random.Random, mean: int) -> int:
        if not self.spread:
            return mean
        return round(mean * (1 + self.spread * (2 * rng.random() - 1)))


LLMD = Shape()


def poisson_arrivals(rng: random.Random, rate: Callable[[float], float], peak: float, duration_s: float,
                     ) -> Iterator[float]:
    """Arrival times of a Poisson process of rate(t) <= peak over [0, duration_s) (thinning)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return
        if rng.random() * peak <= rate(t):
            yield t


def llmd(qps: float, duration_s: float, seed: int = 0, shape: Shape = LLMD) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [shape.request(rng, t) for t in poisson_arrivals(rng, lambda _: qps, qps, duration_s)]


def fixed_count(requests: list[TraceRequest], n: int) -> list[TraceRequest]:
    """The first n requests (a generator run long enough, cut to a count)."""
    if len(requests) < n:
        raise ValueError(f"only {len(requests)} requests generated, {n} asked for: generate a longer trace")
    return requests[:n]


@dataclass(frozen=True)
class ChatShape:
    system_len: int = 1000
    user_len: int = 200
    output_len: int = 300
    mean_turns: float = 6.0
    think_s: float = 20.0  # mean time from one turn to the next (exponential)
    max_context: int = 16_000


def chat(sessions_per_s: float, duration_s: float, seed: int = 0, shape: ChatShape = ChatShape()
         ) -> list[TraceRequest]:
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for i, start in enumerate(poisson_arrivals(rng, lambda _: sessions_per_s, sessions_per_s, duration_s)):
        session = f"session-{i}"
        turns = 1 + min(int(rng.expovariate(1 / max(shape.mean_turns - 1, 1e-9))), 50)
        context, t = shape.system_len, start
        for _ in range(turns):
            context += shape.user_len
            if context + shape.output_len > shape.max_context:
                break
            out.append(TraceRequest(arrival_s=t, output_len=shape.output_len, prefix_group=session,
                                    prefix_len=context, suffix_len=0, session=session))
            context += shape.output_len
            t += rng.expovariate(1 / shape.think_s)
            if t >= duration_s:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(frozen=True)
class DayShape:
    """A day compressed into `day_s` seconds: the rate goes from trough to peak (mid-day) and back; `bursts`
    windows of `burst_s` at `burst_factor` times the curve, at random times."""

    peak_qps: float = 30.0
    trough_ratio: float = 0.15
    day_s: float = 1800.0
    bursts: int = 6
    burst_s: float = 60.0
    burst_factor: float = 2.5
    requests: Shape = Shape(tenants=40, prefix_len=2000, suffix_len=300, output_len=200, spread=0.5)

    def rate(self, t: float, windows: list[tuple[float, float]]) -> float:
        trough = self.peak_qps * self.trough_ratio
        base = trough + (self.peak_qps - trough) * (1 - math.cos(2 * math.pi * t / self.day_s)) / 2
        return base * (self.burst_factor if any(a <= t < b for a, b in windows) else 1.0)


def burst_windows(shape: DayShape, seed: int) -> list[tuple[float, float]]:
    rng = random.Random(seed ^ 0x5EED)
    starts = sorted(rng.uniform(0, shape.day_s - shape.burst_s) for _ in range(shape.bursts))
    return [(s, s + shape.burst_s) for s in starts]


def day(seed: int = 0, shape: DayShape = DayShape()) -> list[TraceRequest]:
    rng = random.Random(seed)
    windows = burst_windows(shape, seed)
    peak = shape.peak_qps * shape.burst_factor
    return [shape.requests.request(rng, t)
            for t in poisson_arrivals(rng, lambda t: shape.rate(t, windows), peak, shape.day_s)]


def with_warmup(trace: list[TraceRequest], shape: Shape, spacing_s: float) -> tuple[list[TraceRequest], int]:
    """One short request per tenant first (its prefix computed once somewhere, as a benchmark's warm-up does),
    `spacing_s` apart, then the trace shifted after them. Returns the trace and how many warm-up requests lead
    it (results count from there: `Collector(skip=...)`)."""
    warm = [TraceRequest(i * spacing_s, 1, prefix_group=f"tenant-{i}", prefix_len=shape.prefix_len, suffix_len=1,
                         tenant=f"tenant-{i}") for i in range(shape.tenants)]
    start = len(warm) * spacing_s
    return warm + [dataclasses.replace(r, arrival_s=r.arrival_s + start) for r in trace], len(warm)
