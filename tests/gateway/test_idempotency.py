"""IdempotentRequests (kvrelay.gateway.idempotency) and Recording (gateway.resumable) on their own: one run
per key, repeats attach or replay, failures are not kept, keys belong to their API key, the store is bounded,
a recording replays from any event, and with Redis a retry on another gateway goes on with the copy running
there. Through a real gateway and the openai SDK: tests/gateway/test_fake_nodes.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from starlette.responses import Response

from kvrelay.common.records import TokenLogprobs
from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.errors import BadRequest, NotFound, Overloaded, RunGone
from kvrelay.gateway.handover import RunRecord, keyed_run
from kvrelay.gateway.idempotency import IDEMPOTENCY_KEY, REQUEST_ID, IdempotentRequests, fingerprint
from kvrelay.gateway.resumable import Recording, last_event_id
from kvrelay.gateway.sequence_state import Placement
from kvrelay.gateway.shared_answers import RequestKey, SharedAnswers

KEY = RequestKey(None, IDEMPOTENCY_KEY, "k1")
BODY = fingerprint("/v1/completions", b'{"prompt": "hi"}')


class Maker:
    """A generation that takes `gate` to finish; counts its runs."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.runs = 0
        self.gate = asyncio.Event()
        self.fail = fail

    async def __call__(self) -> Response:
        self.runs += 1
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return Response(b'{"n": %d}' % self.runs, 200, {"x-ratelimit-remaining-requests": "9", "x-kvrelay-node": "d0"},
                        "application/json")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(**kw):
    replays: list[str] = []
    clock = Clock()
    return IdempotentRequests(60.0, resume_grace_s=30.0, clock=clock, on_replay=replays.append, **kw), replays, clock


def test_a_repeat_while_it_runs_attaches_and_one_after_gets_the_stored_answer():
    async def scenario():
        store, replays, clock = _store()
        make = Maker()
        first = asyncio.create_task(store.run(KEY, BODY, make))
        second = asyncio.create_task(store.run(KEY, BODY, make))
        await asyncio.sleep(0)
        make.gate.set()
        a, b = await first, await second
        assert make.runs == 1 and a.body == b.body == b'{"n": 1}' and replays == ["attached"]
        clock.now = 59.0
        stored = await store.run(KEY, BODY, make)
        assert make.runs == 1 and stored.body == b'{"n": 1}' and replays == ["attached", "stored"]
        assert stored.headers["idempotent-replayed"] == "true" and stored.headers["x-kvrelay-node"] == "d0"
        assert "x-ratelimit-remaining-requests" not in stored.headers  # the first caller's key state
        clock.now = 60.0  # past the ttl: a new run
        assert (await store.run(KEY, BODY, make)).body == b'{"n": 2}' and make.runs == 2

    asyncio.run(scenario())


def test_the_first_caller_hanging_up_leaves_the_run_for_its_retry():
    async def scenario():
        store, replays, _ = _store()
        make = Maker()
        first = asyncio.create_task(store.run(KEY, BODY, make))
        await asyncio.sleep(0)
        first.cancel()  # the client went away (a timeout, a dropped connection)
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = asyncio.create_task(store.run(KEY, BODY, make))
        await asyncio.sleep(0)
        make.gate.set()
        assert (await retry).body == b'{"n": 1}' and make.runs == 1 and replays == ["attached"]

    asyncio.run(scenario())


def test_a_failure_reaches_every_caller_and_is_not_kept():
    async def scenario():
        store, _, _ = _store()
        make = Maker(fail=Overloaded("busy", retry_after=1))
        calls = [asyncio.create_task(store.run(KEY, BODY, make)) for _ in range(2)]
        await asyncio.sleep(0)
        make.gate.set()
        for call in calls:
            with pytest.raises(Overloaded):
                await call
        assert len(store) == 0
        make.fail = None
        assert (await store.run(KEY, BODY, make)).body == b'{"n": 2}' and make.runs == 2

    asyncio.run(scenario())


def test_a_key_reused_for_another_body():
    async def scenario():
        store, _, _ = _store()
        make = Maker()
        make.gate.set()
        await store.run(KEY, BODY, make)
        other = fingerprint("/v1/completions", b'{"prompt": "bye"}')
        with pytest.raises(BadRequest) as refused:
            await store.run(KEY, other, make)
        assert refused.value.code == "idempotency_key_reused" and refused.value.param == "Idempotency-Key"
        # An X-Request-Id promises nothing about the body: another request under it simply runs.
        rid = RequestKey(None, REQUEST_ID, "r1")
        await store.run(rid, BODY, make)
        assert (await store.run(rid, other, make)).body == b'{"n": 3}' and make.runs == 3

    asyncio.run(scenario())


def test_keys_belong_to_their_api_key_and_the_store_is_bounded():
    async def scenario():
        store, _, _ = _store(max_entries=2)
        make = Maker()
        make.gate.set()
        for principal in ("tenant-a", "tenant-b"):
            await store.run(RequestKey(principal, IDEMPOTENCY_KEY, "same"), BODY, make)
        assert make.runs == 2  # the same key from another API key is another request
        await store.run(RequestKey("tenant-a", IDEMPOTENCY_KEY, "third"), BODY, make)
        await store.run(KEY, BODY, make)  # a fourth: the oldest stored answers go
        assert len(store) == 2  # "third" and the fourth
        await store.run(RequestKey("tenant-a", IDEMPOTENCY_KEY, "same"), BODY, make)
        assert make.runs == 5  # it was dropped: it ran again

    asyncio.run(scenario())


def test_a_negative_ttl_is_refused():
    with pytest.raises(ValueError, match="idempotency_ttl"):
        IdempotentRequests(-1, resume_grace_s=30.0)


def test_a_recording_numbers_each_event_and_follows_from_any_point():
    async def scenario():
        rec = Recording()
        await rec.append("data: a\n\ndata: b\n\n")  # one write, two events
        late = asyncio.create_task(_read(rec.follow(0)))  # after event 0: b, then what comes
        await asyncio.sleep(0)
        await rec.append("data: c\n\n")
        await rec.finish()
        assert await late == "id: 1\ndata: b\n\nid: 2\ndata: c\n\n"
        assert await _read(rec.follow(None)) == "id: 0\ndata: a\n\n" + await _read(rec.follow(0))
        assert await _read(rec.follow(2)) == ""

    asyncio.run(scenario())


async def _read(events) -> str:
    return "".join([e async for e in events])


def test_last_event_id_is_a_number():
    assert last_event_id(None) is None and last_event_id("17") == 17
    with pytest.raises(BadRequest, match="Last-Event-ID"):
        last_event_id("x-3")


@contextlib.asynccontextmanager
async def _two_gateways(redis_url: str):
    """Two gateways' stores sharing one Redis (their Redis sides started, stopped after), and what B replayed."""
    shared = SharedAnswers(redis_url), SharedAnswers(redis_url)
    for store in shared:
        await store.start()
    b_replays: list[str] = []
    try:
        yield (IdempotentRequests(60.0, resume_grace_s=30.0, shared=shared[0]),
               IdempotentRequests(60.0, resume_grace_s=30.0, shared=shared[1], on_replay=b_replays.append), b_replays)
    finally:
        for store in shared:
            await store.stop()


def test_a_retry_on_another_gateway_gets_the_answer_stored_in_redis(redis_url):
    """Two gateways' stores sharing a real Redis: the answer one computed is the other's, for the same body and
    API key; another body under the same Idempotency-Key is refused there too."""
    import redis

    async def scenario():
        async with _two_gateways(redis_url) as (a, b, b_replays):
            make = Maker()
            make.gate.set()
            await a.run(KEY, BODY, make)
            while not redis.Redis.from_url(redis_url).keys("kvr:idem:*"):  # written in the background
                await asyncio.sleep(0.01)
            replay = await b.run(KEY, BODY, make)
            assert make.runs == 1 and replay.body == b'{"n": 1}' and b_replays == ["stored"]
            assert replay.headers["idempotent-replayed"] == "true"
            with pytest.raises(BadRequest):
                await b.run(KEY, fingerprint("/v1/completions", b"{}"), make)
            other_tenant = RequestKey("tenant-b", IDEMPOTENCY_KEY, KEY.value)
            assert (await b.run(other_tenant, BODY, make)).body == b'{"n": 2}'

    asyncio.run(scenario())


def test_without_redis_each_gateway_answers_alone(caplog):
    async def scenario():
        shared = SharedAnswers("redis://127.0.0.1:1/0")  # nothing listens there
        await shared.start()
        try:
            store = IdempotentRequests(60.0, resume_grace_s=30.0, shared=shared)
            make = Maker()
            make.gate.set()
            assert (await store.run(KEY, BODY, make)).body == b'{"n": 1}'
            assert (await store.run(KEY, BODY, make)).body == b'{"n": 1}' and make.runs == 1  # its own copy
            other = RequestKey(None, IDEMPOTENCY_KEY, "k2")
            assert (await store.run(other, BODY, make)).body == b'{"n": 2}'
        finally:
            await shared.stop()

    asyncio.run(scenario())
    assert [r for r in caplog.records if "Redis unreachable" in r.getMessage()]


def _record() -> RunRecord:
    """A keyed request placed on a decode node after a hand-off, with logprobs and a prompt's logprobs."""
    first = TokenChunk((11,), (TokenLogprobs(11, -0.5, 1, ((11, -0.5), (12, -1.25))),), num_prompt_tokens=5,
                       num_output_tokens=1, num_cached_tokens=3, prompt_logprobs=(None, TokenLogprobs(4, -2.0, 3)))
    return RunRecord("cmpl-1", Placement("127.0.0.1:5", "decode-0", "cmpl-1-0", (first,), True, 0, False, "prefill-0"))


class Resumer(Maker):
    """A generation that says where it runs (as the dispatcher does once a node streams it), and notes whether
    it was started to go on with another gateway's copy; `gone`: that copy is gone (RunGone)."""

    def __init__(self, gone: bool = False) -> None:
        super().__init__()
        self.resumed: list[RunRecord | None] = []
        self.gone = gone

    async def __call__(self) -> Response:
        run = keyed_run.get()
        assert run is not None and run.keep_s == 30.0
        self.resumed.append(run.resume)
        if run.resume is not None and self.gone:
            raise RunGone("gone")
        if run.resume is None:
            run.publish(_record())
        return await super().__call__()


def test_a_retry_on_another_gateway_goes_on_with_the_copy_running_there(redis_url):
    """Gateway A runs a keyed request and says where it runs; B, asked the same, goes on with that copy
    (the record round-trips through Redis exactly). When that copy is gone, B computes anew; a stream resumed
    with Last-Event-ID that nobody recorded is 404."""
    import redis

    async def scenario():
        async with _two_gateways(redis_url) as (a, b, b_replays):
            on_a = Resumer()
            running = asyncio.create_task(a.run(KEY, BODY, on_a))
            while not redis.Redis.from_url(redis_url).keys("kvr:idem:*"):
                await asyncio.sleep(0.01)
            on_b = Resumer()
            on_b.gate.set()
            await b.run(KEY, BODY, on_b)
            assert on_b.resumed == [_record()] and b_replays == ["attached"]
            gone = Resumer(gone=True)
            gone.gate.set()
            other = RequestKey(None, IDEMPOTENCY_KEY, "k-gone")
            a.shared.put_run(other, BODY, _record(), 60.0)
            while not await b.shared.get(other):
                await asyncio.sleep(0.01)
            await b.run(other, BODY, gone)
            assert gone.resumed == [_record(), None] and gone.runs == 1  # tried to go on, then ran anew
            with pytest.raises(NotFound):
                await b.follow(RequestKey(None, IDEMPOTENCY_KEY, "never"), BODY, 3, Maker())
            on_a.gate.set()
            await running

    asyncio.run(scenario())
