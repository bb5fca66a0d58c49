"""Admission at the gateway: how many generations run, whose, and in what order the nodes take them.

`Activity` counts the gateway's generations in progress (all models share one): graceful shutdown waits for them
and cut() ends them; admission reads the counts per tenant and per API key (gateway.auth).

- At most `max_concurrent_requests` generations at once (429 with Retry-After past it), and at most a key's
  `max_concurrent`.
- Past `shed_at` of that bound, admission is fair across tenants: keys of priority < 0 (sheddable) are refused
  first, then a tenant already holding an equal share of the bound is refused while the others are admitted,
  unless its key's band is above 0. Below it nothing is refused for fairness: the gateway is work-conserving.
- At the nodes, a tenant's request queues behind what other tenants sent since its own requests in flight, and
  behind keys further from their rate limits: its engine priority is that count plus PRESSURE_WEIGHT times the
  share of its key's rate-limit bucket spent (the nodes run lower values first, and a running prompt yields its
  chunks to a waiting request that outranks it; a key's band outranks every count).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvrelay.gateway.auth import DEFAULT_TENANT, Principal
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.errors import Overloaded

_BAND = 1_000_000  # engine priority per priority band of a key (bands are -1000..1000: within int32)
# A key that has spent its whole rate-limit burst ranks behind this many requests in flight of keys that spent
# none: a tenant sending past its limit yields the nodes to tenants within theirs.
PRESSURE_WEIGHT = 64


@dataclass(frozen=True)
class Admission:
    max_concurrent_requests: int = GatewayConfig.max_concurrent_requests  # 0: no bound
    request_timeout_s: float = GatewayConfig.request_timeout  # 0: no deadline
    shed_at: float = GatewayConfig.shed_at  # past this share of the bound: fair across tenants, sheddable first
    tenant_cache_isolation: bool = GatewayConfig.tenant_cache_isolation


class Activity:
    """The gateway's generations in progress, whichever model they are for: admission counts them, shutdown
    drains and cuts them."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # generations in progress (graceful shutdown waits for them)
        self.was_cut = False  # the drain's grace ran out and cut() ended what was still running
        self._running: dict[asyncio.Task, int] = {}  # task -> its generations in progress
        self.by_tenant: dict[str, int] = {}  # tenant -> its generations in progress
        self.by_key: dict[str, int] = {}  # API key name -> its generations in progress

    def cut(self) -> int:
        """End every generation still in progress (the drain's grace is over); how many tasks were cut."""
        self.was_cut = True
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        return len(tasks)

    @contextmanager
    def in_progress(self, principal: Principal | None = None) -> Iterator[None]:
        """Counts a generation while it runs (graceful shutdown waits for them; cut() ends them), by tenant and
        by key for admission."""
        counts = ((self._running, asyncio.current_task()),
                  (self.by_tenant, principal.tenant if principal is not None else DEFAULT_TENANT),
                  (self.by_key, principal.key_id if principal is not None else ""))
        self.active += 1
        for table, name in counts:
            _count(table, name, 1)
        try:
            yield
        finally:
            self.active -= 1
            for table, name in counts:
                _count(table, name, -1)

    def admit(self, admission: Admission, principal: Principal | None) -> None:
        """Overloaded (429) when `principal`'s request may not start now (see the module's doc)."""
        if principal is not None and principal.max_concurrent is not None:
            running = self.by_key.get(principal.key_id, 0)
            if running >= principal.max_concurrent:
                raise Overloaded(f"this API key has {running} requests in progress, its limit "
                                 f"(max_concurrent {principal.max_concurrent}); retry when one ends",
                                 code="concurrency_limit")
        limit = admission.max_concurrent_requests
        if not limit:
            return
        active = self.active
        if active >= limit:
            raise Overloaded(f"the gateway is at its limit of {limit} concurrent requests "
                             "(--max-concurrent-requests); retry later")
        if principal is None or active < limit * admission.shed_at:
            return
        if principal.sheddable:
            raise Overloaded(f"the gateway is past {admission.shed_at:.0%} of its {limit} concurrent requests "
                             "and sheds traffic of priority < 0 first; retry later", code="shed")
        tenant = principal.tenant
        holding = self.by_tenant.get(tenant, 0)
        share = limit / len(self.by_tenant.keys() | {tenant})
        if principal.priority <= 0 and holding >= share:
            raise Overloaded(f"tenant {tenant!r} holds its fair share ({holding} of {limit} concurrent requests) "
                             "while the gateway is under pressure; retry later", code="tenant_share")

    def engine_priority(self, principal: Principal, requested: int, pressure: float = 0.0) -> int:
        """The priority a tenant's request runs with at the nodes (lower first): its tenant's requests in flight,
        plus up to PRESSURE_WEIGHT for how much of its rate-limit bucket its key has spent (`pressure`, 0..1,
        gateway.ratelimit), plus its own request's (never below 0); all after every request of a higher band."""
        return (self.by_tenant.get(principal.tenant, 0) + round(PRESSURE_WEIGHT * pressure) + max(0, requested)
                - _BAND * principal.priority)


def _count(counts: dict, name, delta: int) -> None:
    """Add `delta` to counts[name]; a count back at 0 leaves the dict."""
    n = counts.get(name, 0) + delta
    if n:
        counts[name] = n
    else:
        counts.pop(name, None)
