"""Decode reservations wait for blocks in arrival order instead of failing; waiting is bounded."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.reservation_queue import DuplicateRequest, QueueFull
from tests.helpers.scheduler import EOS, Driver, prompt


def _req(rid: str, n: int, start: int = 10) -> Request:
    return Request(rid, prompt(n, start), SamplingParams(max_tokens=4), eos_token_id=EOS)


@pytest.fixture
def d() -> Driver:
    d = Driver(num_blocks=8)
    d.sched.config = replace(d.config, max_waiting_requests=3)
    return d


def test_full_cache_queues_in_order_and_grants_as_blocks_free(d):
    s = d.sched
    assert s.reserve(_req("a", 64, 100), 30) is not None  # 4 blocks
    assert s.reserve(_req("b", 64, 200), 30) is not None  # 8 of 8
    assert s.reserve(_req("c", 64, 300), 30, queue_until=1e18) is None
    assert s.reserve(_req("d", 16, 400), 30, queue_until=1e18) is None  # behind c, though it is smaller
    assert s.queued.ids() == ["c", "d"] and s.load().num_waiting == 2
    assert s.admit_queued() == ([], [])  # nothing freed
    d.abort("a")
    granted, expired = s.admit_queued()
    assert [r.req_id for r in granted] == ["c"] and not expired  # d does not fit beside c
    assert len(granted[0].dst_block_ids) == 4 and "c" in s.reserved
    d.abort("b")
    granted, _ = s.admit_queued()
    assert [r.req_id for r in granted] == ["d"] and len(s.queued) == 0


def test_no_overtaking_without_waiting(d):
    s = d.sched
    assert s.reserve(_req("a", 120, 100), 30) is not None  # 8 of 8 blocks
    assert s.reserve(_req("b", 16, 200), 30, queue_until=1e18) is None
    d.abort("a")
    # A caller that will not wait is refused while others wait ahead, even though blocks are free now.
    assert s.reserve(_req("c", 16, 300), 30) is None and "c" not in s.queued
    assert [r.req_id for r in s.admit_queued()[0]] == ["b"]


def test_wait_runs_out(d):
    s = d.sched
    assert s.reserve(_req("a", 120, 100), 30) is not None
    assert s.reserve(_req("b", 16, 200), 30, queue_until=5.0) is None
    assert s.admit_queued(now=4.0) == ([], [])
    assert s.admit_queued(now=5.0) == ([], ["b"])
    assert len(s.queued) == 0 and s.load().num_waiting == 0


def test_abort_takes_it_out_of_the_queue(d):
    s = d.sched
    assert s.reserve(_req("a", 120, 100), 30) is not None
    assert s.reserve(_req("b", 16, 200), 30, queue_until=1e18) is None
    free = d.pool.num_free_blocks
    (done,) = s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert done.request_id == "b" and done.status == RequestStatus.FINISHED_ABORTED
    assert d.pool.num_free_blocks == free and len(s.queued) == 0


def test_waiting_is_bounded(d):
    s = d.sched
    assert s.reserve(_req("a", 120, 100), 30) is not None
    d.add("w1", prompt(16, 500))  # a local request waiting too (no step has run)
    for rid in ("q1", "q2"):
        assert s.reserve(_req(rid, 16, 600), 30, queue_until=1e18) is None
    with pytest.raises(QueueFull, match="max_waiting_requests 3"):
        s.reserve(_req("q3", 16, 700), 30, queue_until=1e18)
    with pytest.raises(QueueFull):
        s.check_room_to_wait()
    assert s.reserve(_req("q4", 16, 700), 30) is None  # not waiting: refused, not an error


def test_duplicate_ids_are_refused(d):
    s = d.sched
    assert s.reserve(_req("a", 120, 100), 30) is not None
    assert s.reserve(_req("q", 16, 200), 30, queue_until=1e18) is None
    for rid in ("a", "q"):
        with pytest.raises(DuplicateRequest, match="already in use"):
            s.reserve(_req(rid, 16, 300), 30, queue_until=1e18)
        with pytest.raises(DuplicateRequest):
            d.add(rid, prompt(16, 300))
