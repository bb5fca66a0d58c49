"""What a simulation run reports (`kvrelay sim run` prints it as JSON; the keys are an interface)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvrelay.sim.dispatch import SimRequest


def pct(values: Sequence[float], p: float) -> float | None:
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), p)), 6) if len(values) else None


class Collector:
    """Per-request figures as requests end (their tokens are dropped then). `skip`: the first requests of the
    trace are a warm-up, not counted."""

    def __init__(self, skip: int = 0) -> None:
        self.skip = skip
        self.arrival: list[float] = []
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.tpot: list[float] = []  # a request's mean inter-token gap
        self.finish: list[float] = []
        self.prompt = self.cached = self.anywhere = self.output = 0
        self.failures: dict[str, int] = {}
        self.completed = 0

    def __call__(self, req: SimRequest) -> None:
        if req.index < self.skip:
            req.prompt = req.output = None
            return
        if req.outcome != "ok":
            self.failures[req.outcome] = self.failures.get(req.outcome, 0) + 1
            return
        self.completed += 1
        self.arrival.append(req.arrival_s)
        self.ttft.append(req.first_token_s - req.arrival_s)
        self.e2e.append(req.finish_s - req.arrival_s)
        self.finish.append(req.finish_s)
        n = req.num_tokens
        self.tpot.append((req.finish_s - req.first_token_s) / (n - 1) if n > 1 else 0.0)
        self.prompt += len(req.prompt)
        self.cached += req.cached_tokens
        self.anywhere += max(req.cached_anywhere, req.cached_tokens)
        self.output += n
        req.prompt = req.output = None  # the tokens are no longer needed

    def within(self, slo_ttft_s: float, slo_itl_s: float, total: int) -> float:
        """Share of all `total` requests that completed within both SLOs (TTFT, and mean inter-token gap)."""
        ok = sum(1 for t, g in zip(self.ttft, self.tpot) if t <= slo_ttft_s and g <= slo_itl_s)
        return ok / total if total else 1.0


@dataclass
class RunResult:
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    output_tok_s: float
    prefix_hit_ratio: float
    completed: int
    failed: int
    wall_s: float
    e2e_p50_s: float | None = None
    e2e_p90_s: float | None = None
    would_hit_ratio: float = 0.0  # prompt tokens cached somewhere in the fleet when routed
    load_imbalance: float = 1.0  # max / mean busy time of the nodes that compute prompts
    refused_nodes: int = 0  # nodes the gateways refused (another block size or model: their mismatch metric)
    failures: dict = field(default_factory=dict)
    sim_duration_s: float = 0.0
    events: int = 0
    config: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def summarize(c: Collector, itl: Sequence[float], busy: Sequence[float], wall_s: float, events: int,
              config: dict) -> RunResult:
    failed = sum(c.failures.values())
    span = (max(c.finish) - min(c.arrival)) if c.completed else 0.0
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    return RunResult(
        ttft_p50_s=pct(c.ttft, 50), ttft_p90_s=pct(c.ttft, 90), ttft_p99_s=pct(c.ttft, 99),
        itl_p50_s=pct(itl, 50), itl_p90_s=pct(itl, 90),
        output_tok_s=round(c.output / span, 3) if span > 0 else 0.0,
        prefix_hit_ratio=round(c.cached / c.prompt, 6) if c.prompt else 0.0,
        completed=c.completed, failed=failed, wall_s=round(wall_s, 3),
        e2e_p50_s=pct(c.e2e, 50), e2e_p90_s=pct(c.e2e, 90),
        would_hit_ratio=round(c.anywhere / c.prompt, 6) if c.prompt else 0.0,
        load_imbalance=round(max(busy) / mean_busy, 4) if mean_busy > 0 else 1.0,
        failures=dict(sorted(c.failures.items())), sim_duration_s=round(max(c.finish, default=0.0), 6), events=events,
        config=config,
    )
