"""One simulation: a trace through a fleet shape under a profile, to a RunResult."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict

from kvrelay.sim.fleet import Fleet, FleetSpec
from kvrelay.sim.results import Collector, RunResult, summarize
from kvrelay.sim.timemodel import Profile
from kvrelay.sim.trace import PromptSource, TraceRequest


def simulate(trace: Sequence[TraceRequest], spec: FleetSpec, profile: Profile, seed: int = 0,
             setup: Callable[[Fleet], None] | None = None, collector: Collector | None = None) -> RunResult:
    """Run the trace to the end (every request completed or failed). `setup` may install a controller."""
    t0 = time.perf_counter()
    with _long_lived_heap() as built:
        fleet = Fleet(spec, profile, seed)
        if setup is not None:
            setup(fleet)
        collector = collector or Collector()
        fleet.start(trace, PromptSource(), collector)
        built()
        fleet.loop.run()
    nodes = [*fleet.nodes.values(), *fleet.retired]
    computing = [n for n in nodes if n.role in ("prefill", "colocated")] or [n for n in nodes if n.role == "decode"]
    config = {"prefill": spec.prefill, "decode": spec.decode, "colocated": spec.colocated,
              "gateways": spec.gateways, "policy": spec.policy, "profile": profile.name, "seed": seed,
              "requests": len(trace), "kv_blocks_per_node": fleet.num_blocks, "threads": spec.threads,
              "scheduler": {k: (v.value if hasattr(v, "value") else v) for k, v in asdict(spec.scheduler).items()}}
    result = summarize(collector, fleet.dispatcher.itl, [n.stats.busy_s for n in computing],
                       time.perf_counter() - t0, fleet.loop.num_events, config)
    end = result.sim_duration_s
    result.config["node_hours"] = round(sum(_node_seconds(n, end) for n in nodes) / 3600, 6)
    result.refused_nodes = max(gw.mismatched_nodes() for gw in fleet.gateways)
    return result


@contextmanager
def _long_lived_heap() -> Iterator[Callable[[], None]]:
    """Collect garbage as a batch job would. A fleet is millions of objects that live for the whole run (every
    node's blocks, the prefix caches' hashes, the mirrors' maps), and the run makes small objects by the
    million (block events, outputs): at CPython's default thresholds the collector walks the fleet again and
    again, ~14% of a 64-node run. Young objects are collected less often, and what the fleet holds once built
    (call the function given) is frozen out of the collector's walks until the run ends."""
    before = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _node_seconds(node, end: float) -> float:
    stop = end if node.retired_at is None else min(node.retired_at, end)
    return max(0.0, stop - node.started_at)
