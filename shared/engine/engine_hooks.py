"""What an AsyncEngine (async_engine.py) reports to and raises at the node that drives it: the observer of its
metrics, the sink of its prefix-cache changes, the hook for expired leases, and its two terminal states. The node
implements these; the engine knows nothing of nodes, so they are declared here, beside the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvrelay.common.records import NodeLoad
from kvrelay.engine.block_pool import BlockEventSink
from kvrelay.engine.lora import LoRAStats
from kvrelay.engine.offload.tier import OffloadReport
from kvrelay.engine.scheduler_output import EngineCoreOutput, EngineCounters


class EngineDraining(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineDead(RuntimeError):
    """The engine thread is gone; nothing more will be computed."""


class EngineObserver(Protocol):
    """What the engine thread reports as it runs (a node's metrics)."""

    def observe_stats(self, load: NodeLoad, counters: EngineCounters) -> None: ...

    def observe_lora(self, running: set[str], waiting: set[str], stats: LoRAStats, load_seconds: list[float]) -> None:
        """With LoRA on: the adapters of running and waiting requests, the cumulative counts, and the seconds of
        the adapter reads since the last call."""

    def observe_offload(self, report: OffloadReport) -> None:
        """With an offload tier: this engine's cumulative counts through it, and each tier's."""

    def observe_output(self, out: EngineCoreOutput, since_arrival: float, last_token_at: float | None,
                       now: float, computes_prompt: bool) -> None: ...

    def observe_finished(self, reason: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class EngineHooks:
    """The AsyncEngine's collaborators, all optional, all called on the engine thread."""

    observer: EngineObserver | None = None
    block_events: BlockEventSink | None = None
    # With an offload tier: each tier's index entries, by tier name (`EngineCore.offload_tier_ids`); called on the
    # tier's writer thread, not the engine's.
    tier_events: Mapping[str, BlockEventSink] | None = None
    on_lease_expired: Callable[[list[str]], None] | None = None  # ids whose reservation or held blocks expired
