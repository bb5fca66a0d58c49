"""A node's load, as GetLoad, the registry heartbeat and the metrics report it."""

from __future__ import annotations

from dataclasses import dataclass

from shared.request import RequestStatus

COMPUTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING)


@dataclass(frozen=True)
class LoadSnapshot:
    num_waiting: int = 0
    num_running: int = 0
    num_reserved: int = 0  # decode role: reservations waiting for their KV
    num_held: int = 0  # prefill role: finished requests whose blocks a transfer still reads
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    kv_cache_usage: float = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.num_waiting or self.num_running or self.num_reserved or self.num_held)

    @classmethod
    def of(cls, core) -> LoadSnapshot:
        """Read from an EngineCore, on its thread. Counted here rather than taken from the scheduler's
        stats, which only refresh when it schedules (an abort on an idle engine would leave them stale)."""
        sched, pool = core.scheduler, core.kv.pool
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.requests.values()
                     if r.status in COMPUTING and r.num_computed_tokens < r.num_prompt_tokens)
        return cls(
            num_waiting=len(sched.waiting), num_running=len(sched.running), num_reserved=len(sched.reserved),
            num_held=len(sched.held), queued_prefill_tokens=queued, free_kv_blocks=pool.num_free_blocks,
            total_kv_blocks=pool.num_blocks, kv_cache_usage=pool.usage(),
        )
