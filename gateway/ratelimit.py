"""Requests and tokens per minute per API key, one limit for the whole fleet however many gateways serve it.

Each key with `rpm` or `tpm` (gateway.auth) has two token buckets in Redis, refilled continuously at the limit per
minute: `kvr:rl:{<key>}:r` and `:t`. A bucket holds a burst of two seconds' worth (at least 2 requests or 200
tokens, and never more than the limit): a full minute's worth at once would let a key that was quiet flood the
nodes with a minute of traffic in a second, and even ten seconds' worth, arriving at once, held another tenant's
first tokens behind it (docs/security.md; OpenAI too enforces its per-minute limits over shorter periods, down to
a second's worth).
One server-side script reads and updates both in one round trip, with Redis's own clock, so every gateway sees
the same buckets (AIBrix keeps its per-user RPM/TPM in Redis the same way).

- Admission takes one request if the tokens bucket is not in debt; otherwise, or without a request left, it is a
  429 with Retry-After (the seconds until the bucket refills enough) and OpenAI's body: type `requests` or
  `tokens`, code `rate_limit_exceeded`.
- Tokens are charged when the generation ends, prompt plus completion (exact, not an estimate), and may put the
  bucket in debt: the key's next requests wait until the debt is paid back.
- Every answer to a limited key carries OpenAI's `x-ratelimit-limit-requests`, `-remaining-requests`,
  `-reset-requests` and the three `-tokens` headers ("reset" is the time until the bucket is full again, "1s",
  "6m0s").

Redis unreachable: each gateway keeps buckets of its own for a 1/N share of each limit, N being the gateways seen
alive in Redis last (each one refreshes its presence in `kvr:rl:gateways` every few seconds), and says so in
/health. Redis is tried again every second; the fleet-wide buckets take over as soon as it answers.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from dataclasses import dataclass

from kvrelay.gateway.auth import Principal
from kvrelay.gateway.errors import RateLimited
from kvrelay.index import REDIS_SCHEMES

logger = logging.getLogger(__name__)

_PREFIX = "kvr:rl:"
_PRESENCE = _PREFIX + "gateways"
_PRESENCE_S = 5.0  # how often a gateway says it is alive
_PRESENCE_TTL_S = 15.0  # a gateway not seen for this long no longer counts in the degraded share
_RETRY_REDIS_S = 1.0
_REDIS_TIMEOUT_S = 0.25

# KEYS: requests bucket, tokens bucket. ARGV: requests per minute and burst (0: no limit), tokens per minute and
# burst, 'admit' or 'charge', tokens to charge. Returns {requests ok, requests level, tokens ok, tokens level}.
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function bucket(key, limit, cap, cost, mode)
  if limit <= 0 then return {1, '-1'} end
  local v = redis.call('HMGET', key, 'l', 't')
  local level = tonumber(v[1]) or cap
  local ts = tonumber(v[2]) or now
  level = math.min(cap, level + math.max(0, now - ts) * limit / 60000.0)
  local ok = 1
  if mode == 'take' then
    if level >= cost then level = level - cost else ok = 0 end
  elseif mode == 'peek' then
    if level <= 0 then ok = 0 end
  else
    level = level - cost
  end
  redis.call('HSET', key, 'l', tostring(level), 't', now)
  redis.call('PEXPIRE', key, 120000)
  return {ok, tostring(level)}
end
local rlim, rcap, tlim, tcap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if ARGV[5] == 'admit' then
  local tok = bucket(KEYS[2], tlim, tcap, 0, 'peek')
  local req
  if tok[1] == 1 then req = bucket(KEYS[1], rlim, rcap, 1, 'take')
  else req = bucket(KEYS[1], rlim, rcap, 0, 'peek') end
  return {req[1], req[2], tok[1], tok[2]}
end
local tok = bucket(KEYS[2], tlim, tcap, tonumber(ARGV[6]), 'debit')
return {1, '-1', tok[1], tok[2]}
"""


# A bucket holds BURST_S seconds of its limit, and at least its floor: requests ("r") or tokens ("t").
BURST_S = 2.0
_FLOORS = {"r": 2.0, "t": 200.0}


def burst(limit: float, kind: str = "r", share: float = 1.0) -> float:
    """What a bucket of `limit` per minute holds at most: BURST_S seconds' worth, at least its kind's floor (a
    gateway's `share` of it, where each keeps its own buckets), at most the limit."""
    return min(float(limit), max(limit * BURST_S / 60.0, _FLOORS[kind] / share))


@dataclass(frozen=True)
class BucketState:
    limit: int  # per minute
    level: float  # what is left now (negative: in debt)
    capacity: float | None = None  # the most it holds (None: the limit)

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    @property
    def cap(self) -> float:
        """The most the bucket holds."""
        return self.limit if self.capacity is None else self.capacity

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.cap - self.level) * 60.0 / self.limit)

    @property
    def spent(self) -> float:
        """Share of the bucket spent: 0 when full, 1 when empty or in debt."""
        return min(1.0, max(0.0, 1.0 - self.level / self.cap))

    def wait_s(self, need: float) -> int:
        """Whole seconds (at least 1) until the bucket holds `need`."""
        return max(1, math.ceil((need - self.level) * 60.0 / self.limit))


@dataclass(frozen=True)
class RateDecision:
    requests: BucketState | None
    tokens: BucketState | None

    @property
    def pressure(self) -> float:
        """How hard the key presses on its limits: the larger share of either bucket spent (0: no limits).
        Admission ranks a key near its limit behind keys well within theirs (gateway.admission)."""
        return max((s.spent for s in (self.requests, self.tokens) if s is not None), default=0.0)

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, state in (("requests", self.requests), ("tokens", self.tokens)):
            if state is not None:
                out[f"x-ratelimit-limit-{name}"] = str(state.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(state.remaining)
                out[f"x-ratelimit-reset-{name}"] = duration(state.reset_s)
        return out


# The decision for the request being served (set beside gateway.auth.current_principal by the HTTP guard and the
# gRPC API); admission reads its pressure.
current_rate: contextvars.ContextVar[RateDecision | None] = contextvars.ContextVar("kvrelay_rate", default=None)


def duration(seconds: float) -> str:
    """OpenAI's reset format: '20ms', '1s', '6m0s', '1h2m3s'."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = math.ceil(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{sec}s"


class _LocalBucket:
    """The same bucket as the script's, in this process (the degraded share while Redis is away)."""

    def __init__(self, limit: float, cap: float) -> None:
        self.limit, self.cap = limit, cap
        self.level = cap
        self.ts = time.monotonic()

    def update(self, cost: float, mode: str) -> tuple[bool, float]:
        now = time.monotonic()
        self.level = min(self.cap, self.level + (now - self.ts) * self.limit / 60.0)
        self.ts = now
        ok = True
        if mode == "take":
            ok = self.level >= cost
            if ok:
                self.level -= cost
        elif mode == "peek":
            ok = self.level > 0
        else:
            self.level -= cost
        return ok, self.level


class RateLimiter:
    """`redis_url` None: one gateway alone, buckets in this process (not degraded: there is nobody to share with)."""

    def __init__(self, redis_url: str | None, gateway_id: str) -> None:
        self.redis_url = redis_url
        self.gateway_id = gateway_id
        self.gateways = 1  # alive in the fleet, as last seen in Redis
        self.redis_error: str | None = None
        self._retry_at = 0.0
        self._client = None
        self._script = None
        self._local: dict[tuple[str, str], _LocalBucket] = {}
        self._presence: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.redis_url is None or not self.redis_url.startswith(REDIS_SCHEMES):
            return  # no Redis (static nodes, or the tests' in-process index): this gateway alone
        import redis.asyncio as aredis

        self._client = aredis.Redis.from_url(self.redis_url, socket_timeout=_REDIS_TIMEOUT_S,
                                             socket_connect_timeout=_REDIS_TIMEOUT_S)
        self._script = self._client.register_script(_SCRIPT)
        self._presence = asyncio.create_task(self._announce(), name="ratelimit-presence")

    async def stop(self) -> None:
        if self._presence is not None:
            self._presence.cancel()
        for task in list(self._pending):
            task.cancel()
        if self._client is not None:
            try:
                await self._client.zrem(_PRESENCE, self.gateway_id)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            await self._client.aclose()

    @property
    def degraded_reason(self) -> str | None:
        if self.redis_error is None:
            return None
        return (f"rate limits enforced per gateway (1/{self.gateways} of each limit): Redis unreachable: "
                f"{self.redis_error}")

    async def _announce(self) -> None:
        while True:
            try:
                now = time.time()
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.zadd(_PRESENCE, {self.gateway_id: now})
                    pipe.zremrangebyscore(_PRESENCE, "-inf", now - _PRESENCE_TTL_S)
                    pipe.zcard(_PRESENCE)
                    *_, count = await pipe.execute()
                self.gateways = max(1, int(count))
            except Exception as e:  # noqa: BLE001 - Redis away: the admission path reports it
                logger.debug("rate-limit presence not refreshed: %s", e)
            await asyncio.sleep(_PRESENCE_S)

    # ---------------------------------------------------------------------------------- admission

    async def admit(self, principal: Principal) -> RateDecision:
        """Take one request for `principal`; RateLimited (429) if it has none left or its tokens are in debt."""
        if principal.rpm is None and principal.tpm is None:
            return RateDecision(None, None)
        (req_ok, req), (tok_ok, tok) = await self._run(principal, "admit", 0)
        decision = RateDecision(req, tok)
        if not tok_ok:
            raise RateLimited(f"Rate limit reached for {principal.key_id} on tokens per min (TPM): Limit "
                              f"{principal.tpm}, in debt by {-int(tok.level)}. Please try again in "
                              f"{tok.wait_s(1)}s.", "tokens", tok.wait_s(1), decision.headers())
        if not req_ok:
            raise RateLimited(f"Rate limit reached for {principal.key_id} on requests per min (RPM): Limit "
                              f"{principal.rpm}, Used {principal.rpm}, Requested 1. Please try again in "
                              f"{req.wait_s(1)}s.", "requests", req.wait_s(1), decision.headers())
        return decision

    def charge_tokens(self, principal: Principal | None, tokens: int) -> None:
        """Debit what a finished generation used (prompt + completion); runs in the background."""
        if principal is None or principal.tpm is None or tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._run(principal, "charge", tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _run(self, principal: Principal, op: str, tokens: int):
        rpm, tpm = principal.rpm or 0, principal.tpm or 0
        rcap, tcap = burst(rpm, "r"), burst(tpm, "t")
        if self._script is not None and time.monotonic() >= self._retry_at:
            keys = [f"{_PREFIX}{{{principal.key_id}}}:r", f"{_PREFIX}{{{principal.key_id}}}:t"]
            try:
                r_ok, r_level, t_ok, t_level = await self._script(keys=keys,
                                                                  args=[rpm, rcap, tpm, tcap, op, tokens])
                if self.redis_error is not None:
                    logger.info("rate limits fleet-wide again: Redis answers")
                self.redis_error = None
                return ((bool(r_ok), BucketState(rpm, float(r_level), rcap) if rpm else None),
                        (bool(t_ok), BucketState(tpm, float(t_level), tcap) if tpm else None))
            except Exception as e:  # noqa: BLE001 - any Redis failure: the local share takes over
                if self.redis_error is None:
                    logger.warning("Redis unreachable for rate limits; each gateway enforces 1/%d: %s",
                                   self.gateways, e)
                self.redis_error = f"{type(e).__name__}: {e}"
                self._retry_at = time.monotonic() + _RETRY_REDIS_S
        return self._local_run(principal, op, tokens)

    def _local_run(self, principal: Principal, op: str, tokens: int):
        """The script's logic on this process's buckets, each holding this gateway's share of the limit."""
        share = self.gateways if self._script is not None else 1

        def bucket(kind: str, limit: int | None, cost: float, mode: str) -> tuple[bool, BucketState | None]:
            if limit is None:
                return True, None
            mine = max(1, limit // share)
            cap = burst(mine, kind, share)
            b = self._local.get((principal.key_id, kind))
            if b is None or b.limit != mine:
                b = self._local[(principal.key_id, kind)] = _LocalBucket(mine, cap)
            ok, level = b.update(cost, mode)
            return ok, BucketState(mine, level, cap)

        if op == "charge":
            return (True, None), bucket("t", principal.tpm, tokens, "debit")
        tok = bucket("t", principal.tpm, 0, "peek")
        return bucket("r", principal.rpm, 1 if tok[0] else 0, "take" if tok[0] else "peek"), tok
