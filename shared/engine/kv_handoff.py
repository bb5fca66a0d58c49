"""Disaggregation beside the scheduler's queues: the blocks a decode node sets aside for prompts a prefill node
will compute, and the blocks a prefill node keeps after a request ends while its transfer may still read them.

Decode role: a reservation holds the blocks for a prompt past its prefix-cache hit, under a lease; one that
does not fit waits in the ReservationQueue (reservation_queue.py). When the KV has arrived the scheduler
admits the request into its running batch (`Scheduler.admit_reserved`); when the lease runs out first it
aborts it. Prefill role: a request whose prompt KV goes to a peer (`kv_sends`) has its blocks held past its
end, until the transfer is over (`release`) or that lease runs out.

The scheduler moves the requests between its queues; this keeps the leases and the blocks' side of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvrelay.engine.kv_cache_manager import KVCacheManager, PrefixHit, cdiv
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.reservation_queue import ReservationQueue
from kvrelay.engine.scheduler_output import KVSend, Reservation


class KVHandoff:
    """`clock`: where lease deadlines are read (monotonic seconds; a simulator passes its own clock)."""

    def __init__(self, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self.reserved: dict[str, float] = {}  # decode role: req id -> lease deadline
        self.held: dict[str, float] = {}  # prefill role: req id -> lease deadline
        self.queued = ReservationQueue()  # reservations waiting for blocks

    def has_leases(self) -> bool:
        return bool(self.reserved or self.held)

    # -- decode role ------------------------------------------------------------------------------------

    def reserve(self, req: Request, hit: PrefixHit, lease_s: float) -> Reservation | None:
        """Blocks for the prompt past its prefix-cache hit, leased for `lease_s` (None: they are not there)."""
        if self.kv.allocate_slots(req, req.num_prompt_tokens - hit.num_tokens, hit, cache=False) is None:
            self.kv.free(req)
            return None
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
        deadline = self.clock() + lease_s
        self.reserved[req.request_id] = deadline
        dst = self.kv.block_ids(req.request_id)[hit.num_tokens // self.kv.block_size :]  # past resident and loaded
        return Reservation(req.request_id, hit.num_tokens, tuple(dst), deadline)

    def end_reservation(self, request_id: str) -> bool:
        """Its KV arrived, or it ends unfilled (False: no such reservation)."""
        return self.reserved.pop(request_id, None) is not None

    # -- prefill role -----------------------------------------------------------------------------------

    def kv_sends(self, scheduled: Iterable[tuple[Request, int]]) -> tuple[KVSend, ...]:
        """Of the requests scheduled (with their token counts), those whose prompt completes this step and
        whose KV goes to a peer."""
        sends = []
        for req, n in scheduled:
            spec, rid = req.kv_send, req.request_id
            if spec is None or req.num_computed_tokens + n < req.num_prompt_tokens or req.kv_send_started:
                continue
            blocks = self.kv.block_ids(rid)[spec.skip_blocks : cdiv(req.num_prompt_tokens, self.kv.block_size)]
            if len(blocks) != len(spec.dst_block_ids):
                raise ValueError(
                    f"dst_block_ids: {len(spec.dst_block_ids)} given for {len(blocks)} blocks of request {rid}"
                )
            req.kv_send_started = True
            sends.append(KVSend(rid, spec.transfer_id, spec.peer, tuple(blocks), spec.dst_block_ids))
        return tuple(sends)

    def hold(self, req: Request, lease_s: float) -> None:
        """The request ended while its blocks may be in flight: keep them for `lease_s` at most."""
        self.kv.hold(req)
        self.held[req.request_id] = self.clock() + lease_s

    def release(self, request_id: str) -> bool:
        """The transfer that read these blocks is over."""
        self.held.pop(request_id, None)
        return self.kv.release(request_id)

    # -- both -------------------------------------------------------------------------------------------

    def expired(self, now: float) -> tuple[list[str], list[str]]:
        """(reservations, held requests) whose lease ran out by `now`."""
        return ([rid for rid, t in self.reserved.items() if t <= now],
                [rid for rid, t in self.held.items() if t <= now])
