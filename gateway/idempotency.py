"""Idempotent retries: a request sent again under the same key is answered once.

The openai SDK retries a non-streaming request that failed on a connection error (`max_retries`, 2 by
default), with the same headers. Without this, each retry computes the whole request again, while the first
copy may still be generating. A key names a request:
- `Idempotency-Key` (Stripe's and the IETF draft's header). The same key with a different body is refused
  (400, code `idempotency_key_reused`).
- `X-Request-Id`, which kvrelay already uses as the request's id. A different body under the same id runs as
  a new request, because an id is not a promise about the body.

Keys belong to the API key that sent them: one tenant never gets another's answer.

What a repeat gets:
- While the first copy runs, a repeat waits for it and gets the same answer.
- The first copy keeps running when its client hangs up. The generation is what the retry wants.
- For `ttl_s` after a success, a repeat gets the stored answer, with `Idempotent-Replayed: true`.
- A failure is not stored: waiting repeats get the same error, and the next one runs again, since overload
  429s and 503s are meant to be retried.

A keyed stream is recorded instead (gateway.resumable): a repeat follows it, and one with `Last-Event-ID`
resumes it after that event. The store is this gateway's, in memory, and bounded (`max_entries`; the oldest
finished answers go first).

With Redis, keyed requests are the fleet's (gateway.shared_answers, gateway.handover):
- A retry that reaches another gateway after the first copy finished gets its stored answer there.
- While the first copy runs, its record says where. A retry or a stream's reconnect that reaches another
  gateway (the first one died, or a load balancer chose another) goes on with the running sequence, and no
  token is computed twice. A stream's events come out the same on every gateway, so `Last-Event-ID` means the
  same everywhere.
- When the record's node no longer keeps the sequence, a retry computes it anew, and a reconnect with
  `Last-Event-ID` gets 404 `stream_not_found`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from kvrelay.gateway.auth import current_principal
from kvrelay.gateway.errors import BadRequest, NotFound, RunGone
from kvrelay.gateway.handover import KeyedRun, RunRecord, keyed_run
from kvrelay.gateway.resumable import RecordedStream, last_event_id
from kvrelay.gateway.serving_common import SSEResponse
from kvrelay.gateway.shared_answers import RequestKey, SharedAnswers, SharedEntry, StoredAnswer

IDEMPOTENCY_KEY = "idempotency-key"
REQUEST_ID = "x-request-id"
LAST_EVENT_ID = "last-event-id"
# Headers that belong to the first caller's answer, not to a replay (its key's rate-limit state).
_OWN_HEADERS = ("x-ratelimit-", "retry-after", "content-length")


@dataclass
class _Entry:
    fingerprint: bytes
    run: asyncio.Task | None  # the first copy, while it runs (a stream's: until it has started)
    stored: StoredAnswer | None = None  # its answer, once it succeeded
    stream: RecordedStream | None = None  # a stream's recording, once it started


def request_key(headers: Headers, principal: str | None) -> RequestKey | None:
    """The key a request names (`Idempotency-Key` first), or None."""
    for header in (IDEMPOTENCY_KEY, REQUEST_ID):
        value = headers.get(header)
        if value:
            return RequestKey(principal, header, value)
    return None


def fingerprint(path: str, body: bytes) -> bytes:
    return hashlib.blake2b(path.encode() + b"\0" + body, digest_size=16).digest()


class IdempotentRequests:
    """`on_replay(kind)`: a request was answered by an earlier copy ("attached": it ran; "stored": it had
    finished). `shared`: the fleet's stored answers (in Redis), read when this gateway holds no copy."""

    def __init__(self, ttl_s: float, *, resume_grace_s: float, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic, on_replay: Callable[[str], None] | None = None,
                 shared: SharedAnswers | None = None) -> None:
        if ttl_s < 0:
            raise ValueError(f"idempotency_ttl: must be >= 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.resume_grace_s = resume_grace_s  # a stream nobody follows any more runs on this long for a reconnect
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[RequestKey, _Entry] = {}
        self._finished: OrderedDict[RequestKey, float] = OrderedDict()  # stored answers: when each expires
        self._on_replay = on_replay or (lambda kind: None)
        self.shared = shared

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._entries)

    async def answer(self, request: Request, stream: bool, make: Callable[[], Awaitable[Response]]) -> Response:
        """A generation's answer: `make()`'s, or, when it is keyed (by the API key that sent it), an earlier
        copy's answer or the recording of its stream."""
        principal = current_principal.get()
        key = request_key(request.headers, principal and principal.key_id) if self.enabled else None
        if key is None:
            return await make()
        print_ = fingerprint(request.url.path, await request.body())
        if stream:
            return await self.follow(key, print_, last_event_id(request.headers.get(LAST_EVENT_ID)), make)
        return await self.run(key, print_, make)

    async def follow(self, key: RequestKey, print_: bytes, after: int | None,
                     start: Callable[[], Awaitable[Response]]) -> Response:
        """A keyed stream: its recording from the event after `after` (None: from the start), the stream
        started by `start()` unless it runs or ran within ttl_s."""
        self._expire()
        entry = self._entries.get(key)
        if entry is not None and entry.fingerprint != print_:
            self._refuse_reuse(key)
            if after is None:
                return await start()  # an X-Request-Id reused for another stream: it runs on its own
            entry = None
        if entry is not None and after is None and entry.stream is not None and entry.stream.abandoned:
            self._forget(key)  # aborted for want of a client: the request sent anew runs anew
            entry = None
        resume = None
        if entry is None:
            found = await self._elsewhere(key, print_, patient=after is not None)
            resume = found.run if found is not None else None
            entry = self._entries.get(key)
        if entry is None:
            if after is not None and resume is None:
                raise NotFound(f"Last-Event-ID: no stream under {key.value!r} to resume (it ended more than "
                               f"{self.ttl_s:g} s ago, or its gateway could not say where it runs); send the "
                               "request anew", param="Last-Event-ID", code="stream_not_found")
            first = asyncio.create_task(self._start_stream(key, print_, start, resume, after))
            first.add_done_callback(_retrieve)
            entry = self._entries[key] = _Entry(print_, first)
        else:
            self._on_replay("stored" if entry.stream is not None and entry.stream.task.done() else "attached")
        assert entry.run is not None
        recorded = await asyncio.shield(entry.run)
        return recorded.response(after) if isinstance(recorded, RecordedStream) else recorded

    async def _start_stream(self, key: RequestKey, print_: bytes, start: Callable[[], Awaitable[Response]],
                            resume: RunRecord | None, after: int | None):
        # Routing and the first token: errors are the callers' 4xx/5xx.
        response = await self._started(key, print_, start, resume, after)
        if not isinstance(response, SSEResponse):
            self._entries.pop(key, None)
            return response
        recorded = self._entries[key].stream = RecordedStream(response, self.resume_grace_s)
        recorded.task.add_done_callback(lambda _: self._finished.__setitem__(key, self._clock() + self.ttl_s))
        return recorded

    def _refuse_reuse(self, key: RequestKey) -> None:
        if key.header == IDEMPOTENCY_KEY:
            raise BadRequest(f"Idempotency-Key: {key.value!r} was used for a different request in the last "
                             f"{self.ttl_s:g} s; use a new key for a new request", param="Idempotency-Key",
                             code="idempotency_key_reused")

    async def run(self, key: RequestKey, print_: bytes, start: Callable[[], Awaitable[Response]]) -> Response:
        """The answer to the request `key` names, with body fingerprint `print_`: `start()` makes it, unless a
        copy runs or ran within ttl_s."""
        self._expire()
        entry = self._entries.get(key)
        resume = None
        if entry is None:
            found = await self._elsewhere(key, print_)  # another gateway's answer, or where its copy runs
            if found is not None and found.answer is not None:
                self._on_replay("stored")
                return found.answer.response()
            resume = found.run if found is not None else None
            entry = self._entries.get(key)
        if entry is not None and entry.fingerprint != print_:
            self._refuse_reuse(key)
            return await start()  # an X-Request-Id reused for another request: nothing to share
        if entry is None:
            first = asyncio.create_task(self._first(key, print_, start, resume))
            first.add_done_callback(_retrieve)  # its error is its callers'; when all hung up, nobody's
            entry = self._entries[key] = _Entry(print_, first)
        elif entry.stored is not None:
            self._on_replay("stored")
            return entry.stored.response()
        else:
            self._on_replay("attached")
        assert entry.run is not None
        # Shielded: a caller that hangs up leaves the generation running for the retry it will send.
        return await asyncio.shield(entry.run)

    @property
    def _fleet(self) -> bool:
        """Keyed requests are shared with the other gateways (through Redis)."""
        return self.shared is not None and self.shared.enabled

    async def _elsewhere(self, key: RequestKey, print_: bytes, patient: bool = False) -> SharedEntry | None:
        """What another gateway stored under `key` for this body: its answer, or where its copy runs (counted as
        attached). None: nothing, Redis away, a copy that started here meanwhile, or another body (refused for
        an Idempotency-Key; an X-Request-Id reused for another request runs on its own)."""
        found = await self.shared.get(key, patient) if self._fleet else None
        if found is None or key in self._entries:
            return None
        if found.fingerprint != print_:
            self._refuse_reuse(key)
            return None
        if found.answer is None and found.run is not None:
            self._on_replay("attached")
        return found

    async def _started(self, key: RequestKey, print_: bytes, start: Callable[[], Awaitable[Response]],
                       resume: RunRecord | None = None, after: int | None = None) -> Response:
        """`start()`'s answer, run as a KeyedRun with Redis (going on with `resume` if set: where another
        gateway's copy runs; if that is gone, computed anew, unless the client resumes a stream after event
        `after`). If it fails, the key is forgotten (a failure is not kept) and the error raised."""
        try:
            if not self._fleet:
                return await start()
            try:
                keyed_run.set(self._keyed(key, print_, resume, exact=after is not None))
                return await start()
            except RunGone:
                if resume is None or after is not None:
                    raise
                keyed_run.set(self._keyed(key, print_, None))
                return await start()
        except BaseException:
            self._entries.pop(key, None)
            raise

    def _keyed(self, key: RequestKey, print_: bytes, resume: RunRecord | None, exact: bool = False) -> KeyedRun:
        shared, ttl_s = self.shared, self.ttl_s
        assert shared is not None
        return KeyedRun(self.resume_grace_s, resume, exact,
                        lambda record: shared.put_run(key, print_, record, ttl_s))

    async def _first(self, key: RequestKey, print_: bytes, start: Callable[[], Awaitable[Response]],
                     resume: RunRecord | None) -> Response:
        entry = self._entries[key]
        response = await self._started(key, print_, start, resume)
        if 200 <= response.status_code < 300 and isinstance(response.body, bytes):
            headers = tuple((k, v) for k, v in response.headers.items() if not k.lower().startswith(_OWN_HEADERS))
            entry.stored = StoredAnswer(response.status_code, response.body, response.media_type, headers)
            entry.run = None
            self._finished[key] = self._clock() + self.ttl_s
            if self.shared is not None:
                self.shared.put(key, entry.fingerprint, entry.stored, self.ttl_s)
        else:
            self._entries.pop(key, None)
        return response

    def _expire(self) -> None:
        """Drop stored answers past their time, and the oldest ones until a new entry fits in max_entries
        (running ones stay)."""
        now, finished = self._clock(), self._finished
        while finished:
            key, expires = next(iter(finished.items()))
            if expires > now and len(self._entries) < self.max_entries:
                break
            self._forget(key)

    def _forget(self, key: RequestKey) -> None:
        self._finished.pop(key, None)
        self._entries.pop(key, None)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
