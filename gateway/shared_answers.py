"""Stored answers of keyed requests in Redis, so that a retry that reaches another gateway gets them too.

gateway.idempotency keeps each gateway's answers in its memory. Behind a load balancer, a client's retry often
lands on another gateway: a response lost on the way back (a reset connection, a proxy's timeout) is sent
again there. Each gateway therefore also writes a successful non-streaming answer to
`kvr:idem:<hash of the API key id, header and key>`, a hash of its body fingerprint and the answer, expiring
with the idempotency ttl. A gateway that does not hold a key itself reads it there before it computes.

While a keyed request runs, the same hash holds its RunRecord (gateway.handover): where its sequence runs, and
what its client got before that node's stream. A gateway that finds a record but no answer goes on with the
running copy instead of computing again: a non-streaming retry gets the answer the first copy is generating,
and a stream resumes on any gateway.

What is lost while Redis is down: the records written meanwhile. A retry then computes again, and a stream can
only be resumed on the gateway that runs it (as without Redis).

Redis is never on the critical path of a new request: each call has a 0.25 s timeout, and after a failure Redis
is left alone for a second. Meanwhile keyed requests behave as if each gateway were alone. A stream's reconnect
(`Last-Event-ID`) that this gateway cannot answer from its own memory is the exception: without the record it
could only be refused, so its lookup waits up to 2 s, even while Redis is being left alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from starlette.responses import Response

from kvrelay.gateway.handover import RunRecord, record_from_json, record_to_json
from kvrelay.index import REDIS_SCHEMES

logger = logging.getLogger(__name__)

REPLAYED = "Idempotent-Replayed"  # the header a replayed answer carries


@dataclass(frozen=True)
class RequestKey:
    """Who sent it (the API key's id; None without keys), which header named it, and its value."""

    principal: str | None
    header: str
    value: str


@dataclass(frozen=True)
class StoredAnswer:
    """A successful non-streaming answer, as a replay sends it (the first caller's own headers left out)."""

    status: int
    body: bytes
    media_type: str | None
    headers: tuple[tuple[str, str], ...]

    def response(self) -> Response:
        return Response(self.body, self.status, {**dict(self.headers), REPLAYED: "true"}, self.media_type)


_PREFIX = "kvr:idem:"
_TIMEOUT_S = 0.25
_RETRY_S = 1.0
_PATIENT_S = 2.0  # a reconnecting stream's lookup: without the record it could only be refused


@dataclass(frozen=True)
class SharedEntry:
    """What Redis holds under a key: the body's fingerprint, and the answer once stored, or where it runs."""

    fingerprint: bytes
    answer: StoredAnswer | None
    run: RunRecord | None


def redis_key(key: RequestKey) -> str:
    raw = json.dumps([key.principal, key.header, key.value]).encode()
    return _PREFIX + hashlib.blake2b(raw, digest_size=16).hexdigest()


class SharedAnswers:
    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self._client = None
        self._down_until = 0.0
        self._pending: set[asyncio.Task] = set()

    async def start(self) -> None:
        if not self.redis_url.startswith(REDIS_SCHEMES):
            return  # the tests' in-process index: answers stay per gateway
        import redis.asyncio as aredis

        self._client = aredis.Redis.from_url(self.redis_url, socket_timeout=_TIMEOUT_S,
                                             socket_connect_timeout=_TIMEOUT_S)

    @property
    def enabled(self) -> bool:
        """Started against a real Redis (the tests' in-process index has none: answers stay per gateway)."""
        return self._client is not None

    async def stop(self) -> None:
        for task in list(self._pending):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def get(self, key: RequestKey, patient: bool = False) -> SharedEntry | None:
        """What any gateway stored under `key`, or None (nothing, or Redis away). `patient`: the caller cannot
        be answered without it (a stream's reconnect): ask even while Redis seems away, and wait longer."""
        if not (self._usable() or (patient and self._client is not None)):
            return None
        try:
            fields = await asyncio.wait_for(self._client.hgetall(redis_key(key)),
                                            _PATIENT_S if patient else _TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure: answer as a gateway alone would
            self._failed(e)
            return None
        if b"f" not in fields:
            return None
        try:
            answer = run = None
            if b"b" in fields:
                headers = tuple((k, v) for k, v in json.loads(fields[b"h"]))
                answer = StoredAnswer(int(fields[b"s"]), fields[b"b"], fields[b"m"].decode() or None, headers)
            elif b"r" in fields:
                run = record_from_json(fields[b"r"])
            return SharedEntry(fields[b"f"], answer, run)
        except (KeyError, ValueError, TypeError) as e:
            logger.warning("idempotency: an unreadable entry in Redis is ignored: %r", e)
            return None

    def put(self, key: RequestKey, fingerprint: bytes, answer: StoredAnswer, ttl_s: float) -> None:
        """Store an answer for `ttl_s`, in the background (the caller does not wait for Redis)."""
        self._write(key, {"f": fingerprint, "s": str(answer.status), "b": answer.body,
                          "m": answer.media_type or "", "h": json.dumps(list(answer.headers))}, ttl_s)

    def put_run(self, key: RequestKey, fingerprint: bytes, record: RunRecord, ttl_s: float) -> None:
        """Where the request `key` runs now, for `ttl_s` (or until its answer replaces it), in the background."""
        self._write(key, {"f": fingerprint, "r": record_to_json(record)}, ttl_s)

    def _write(self, key: RequestKey, mapping: dict, ttl_s: float) -> None:
        if not self._usable():
            return
        task = asyncio.create_task(self._put(redis_key(key), mapping, ttl_s))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _put(self, name: str, mapping: dict, ttl_s: float) -> None:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(name, mapping=mapping)
                pipe.pexpire(name, max(1, int(ttl_s * 1000)))
                await asyncio.wait_for(pipe.execute(), _TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - what it says stays in this gateway's memory all the same
            self._failed(e)

    def _usable(self) -> bool:
        return self._client is not None and time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        if time.monotonic() >= self._down_until:
            logger.warning("idempotency: Redis unreachable (%r); answers stay per gateway for now", error)
        self._down_until = time.monotonic() + _RETRY_S
