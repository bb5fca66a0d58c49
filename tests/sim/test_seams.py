"""The small seams the simulator needs in production classes: the mirror's map answers lookups by itself, and
the KV hand-off reads its leases on the clock it is given."""

from __future__ import annotations

import random

import pytest

from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.kv_handoff import KVHandoff
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler
from kvrelay.index.memory import MemoryIndex, MemoryStore
from kvrelay.index.mirror import MirrorState
from kvrelay.index.redis_index import event_records


def test_mirror_state_answers_like_the_index():
    rng = random.Random(1)
    hashes = [rng.randbytes(16) for _ in range(40)]
    index, state, direct = MemoryIndex(MemoryStore(), "m"), MirrorState(), MirrorState()
    for node in ("a", "b", "c"):
        for _ in range(3):
            events = [BlockEvent(rng.choice(list(BlockEventKind)), rng.choice(hashes)) for _ in range(30)]
            index.apply(node, events)
            changed = state.apply(node, event_records(events).encode())
            # What the simulator hands over: the same changes without the records' hex text.
            assert direct.apply_changes(node, [e.block_hash for e in events],
                                        [e.kind is BlockEventKind.STORED for e in events]) == changed
        stores = [rng.choice(hashes) for _ in range(5)]
        index.apply(node, [BlockEvent(BlockEventKind.STORED, h) for h in stores])
        assert direct.apply_changes(node, stores) == state.apply(node, b"".join(b"+" + h.hex().encode()
                                                                                for h in stores))
    assert (direct.holders, direct.counts, direct.bits) == (state.holders, state.counts, state.bits)
    records = event_records(events).encode()
    for bad in (records[:-1], records[:-2], records + b"+", records.replace(b"+", b"*")):
        with pytest.raises(ValueError):
            state.apply("a", bad)
    for _ in range(50):
        chain = rng.sample(hashes, rng.randint(1, 10))
        assert state.lookup(chain) == index.lookup(chain)
        assert state.lookup(chain, ["a", "c"]) == index.lookup(chain, ["a", "c"])


def test_leases_run_on_the_given_clock():
    now = [100.0]
    kv = KVCacheManager(BlockPool(16), 4, "m")
    handoff = KVHandoff(kv, clock=lambda: now[0])
    sched = Scheduler(SchedulerConfig(), kv, 64, handoff=handoff)
    res = sched.reserve(Request("r", list(range(10)), SamplingParams(max_tokens=2), None, 0.0), lease_s=5.0)
    assert res.deadline == 105.0
    now[0] = 104.0
    assert sched.expire_leases() == []
    now[0] = 105.0
    sched.expire_leases()
    assert "r" not in sched.requests and kv.num_free_blocks == 16
    # Queued reservations give up waiting on the same clock.
    big = Request("q", list(range(60)), SamplingParams(max_tokens=2), None, 0.0)
    sched.reserve(Request("f", list(range(40)), SamplingParams(max_tokens=2), None, 0.0), lease_s=50.0)
    assert sched.reserve(big, lease_s=5.0, queue_until=106.0) is None and "q" in sched.queued
    now[0] = 107.0
    assert sched.admit_queued() == ([], ["q"])
