"""Pick the prefill and decode nodes of one request.

hash the prompt's blocks (kvrelay.common.hashing, the engines' own function) -> one index lookup for every node ->
score each role's candidates with the policy -> the best decode node, and the best prefill node unless the
decode node should prefill itself (few tokens to compute, or no prefill node up). The ranked rest of each
role is kept as the fallback order when a node refuses or fails.

The index lookup never blocks the event loop: an `async def lookup` is awaited, a blocking one runs on a
small thread pool, either under `lookup_timeout_s`. A failed or slow lookup routes without prefix
information, and the next lookups are skipped for a while (1 s, doubling up to 10 s while it keeps
failing; 1 s once discovery reads the registry, on the same Redis, again), so an index outage costs each
request nothing but its cache affinity, and routing finds the prefixes again soon after Redis returns.

A node with an offload tier names the tier's index entries (`kv_tiers`, one per tier, shared by the host's nodes
that use it). Its cached prefix is its resident one, then the run of blocks its tiers hold from there: read from
the same lookup when nothing is resident, and with one more lookup per distinct resident length otherwise. With
memory and disk tiers, a run that ends in one tier may go on in the other (a conversation's older blocks went down
to disk first), so each lookup's end is looked up again, in both, until neither goes on; `_MAX_TIER_LOOKUPS` in
all, for the longest prefixes. The policy weighs the loaded part by the node's measured load cost.

A request for a LoRA adapter hashes its blocks with the adapter (a prefix is shared within one adapter only), and
its candidates are the nodes that can run the adapter, each costing what `lora_costs` says its residency adds
(gateway.adapters: loaded, room to load it, or only by evicting another).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import xxhash

from kvrelay.common.hashing import kv_dtype_key, prompt_block_hashes
from kvrelay.common.records import ImageInput
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.discovery import Discovery, Node
from kvrelay.gateway.errors import NoCapacity
from kvrelay.gateway.policies import Candidate, Policy, Prompt, decode_is_local

logger = logging.getLogger(__name__)

_AFFINITY_BLOCKS = 8  # leading blocks that name a prompt's "tenant" for tie-breaks
_MAX_TIER_LOOKUPS = 6  # lookups of tier runs past resident prefixes, per request
TierHits = dict[int, dict[str, int]]  # from this block on -> tier entry -> the blocks it holds in a row


@dataclass(frozen=True)
class RouteDecision:
    decode: Node
    prefill: Node | None  # None: the decode node prefills locally
    num_prompt_tokens: int
    decode_cached_tokens: int  # as the index saw it when routing
    prefill_cached_tokens: int
    decode_fallbacks: tuple[Node, ...] = ()
    prefill_fallbacks: tuple[Node, ...] = ()
    seconds: float = 0.0
    fleet_cached_tokens: int = 0  # the longest prefix any node or tier held, as the index saw it (what could have hit)

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None


class Count:
    """Adds `amount` to counts[key] while entered. A class rather than @contextmanager: it runs several times
    per request, on the way to the first token."""

    __slots__ = ("counts", "key", "amount")

    def __init__(self, counts: dict[str, int], key: str, amount: int) -> None:
        self.counts, self.key, self.amount = counts, key, amount

    def __enter__(self) -> Count:
        self.counts[self.key] = self.counts.get(self.key, 0) + self.amount
        return self

    def __exit__(self, *exc) -> None:
        left = self.counts[self.key] - self.amount
        if left:
            self.counts[self.key] = left
        else:
            del self.counts[self.key]


@dataclass
class InFlight:
    """This gateway's own work per node; the published load lags by a heartbeat."""

    seqs: dict[str, int] = field(default_factory=dict)
    prefill_tokens: dict[str, int] = field(default_factory=dict)


_SKIP_MIN_S, _SKIP_MAX_S = 1.0, 10.0


class Router:
    def __init__(self, discovery: Discovery, policy: Policy, index=None, local_prefill_threshold: int = 0,
                 metrics=None, lookup_timeout_s: float = GatewayConfig.lookup_timeout,
                 lora_costs: Callable[[Node, str], float | None] | None = None) -> None:
        self.discovery = discovery
        self.lora_costs = lora_costs
        self.policy = policy
        self.index = index
        self.local_prefill_threshold = local_prefill_threshold
        self.metrics = metrics
        self.lookup_timeout_s = lookup_timeout_s
        self.inflight = InFlight()
        self.model_id = discovery.config.model_id
        self.block_size = discovery.config.block_size
        self.kv_dtype = kv_dtype_key(discovery.config.kv_cache_dtype)
        self._lookup_is_async = index is not None and inspect.iscoroutinefunction(index.lookup)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.index_error: str | None = None
        self._failed_at = self._skip_until = 0.0
        self._skip_s = _SKIP_MIN_S

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def route(self, prompt_token_ids: Sequence[int], cache_salt: str = "",
                    exclude: Collection[str] = (), user: str | None = None, lora_name: str = "",
                    images: Sequence[ImageInput] = ()) -> RouteDecision:
        """`exclude`: node ids not to pick (the nodes a request just failed on). `user`: a session-affinity
        hint (the same user goes to the same node while loads are comparable). `lora_name`: its adapter.
        `images`: the prompt's images, whose content hashes key the blocks they fall in."""
        start = time.perf_counter()
        decode_nodes = self._candidates_of("decode", exclude)
        prefill_nodes = self._candidates_of("prefill", exclude)
        extra = None
        if lora_name:
            extra = self._lora_extra(decode_nodes + prefill_nodes, lora_name)
            decode_nodes = [n for n in decode_nodes if n.node_id in extra]
            prefill_nodes = [n for n in prefill_nodes if n.node_id in extra]
        if not decode_nodes:
            raise NoCapacity(f"no decode node {'that runs LoRA adapter ' + repr(lora_name) + ' ' if lora_name else ''}"
                             "is up; retry later")
        hashes = self._hashes(prompt_token_ids, cache_salt, lora_name, images)
        hits = await self._lookup(hashes) if hashes and self.policy.uses_cache else {}
        nodes = decode_nodes + prefill_nodes
        tier_hits: TierHits | None = None
        if sees_tiers(hits, nodes):
            tier_hits = {}
            while wanted := tier_lookups(hashes, hits, tier_hits, nodes):
                for offset, tiers in wanted.items():
                    tier_hits[offset] = await self._lookup(hashes[offset:], tiers)
        decision = self.decide(prompt_token_ids, hashes, hits, prefill_nodes, decode_nodes, start, user, extra,
                               tier_hits)
        if self.metrics is not None:
            self.metrics.observe_route(decision)
        return decision

    def _candidates_of(self, role: str, exclude: Collection[str]) -> list[Node]:
        nodes = self.discovery.routable(role)
        return [n for n in nodes if n.node_id not in exclude] if exclude else nodes

    def _hashes(self, prompt_token_ids: Sequence[int], cache_salt: str, lora_name: str = "",
                images: Sequence[ImageInput] = ()) -> list[bytes]:
        return prompt_block_hashes(prompt_token_ids, self.model_id, self.block_size, cache_salt, lora_name,
                                   self.kv_dtype, images)

    def _lora_extra(self, nodes: list[Node], lora_name: str) -> dict[str, float]:
        """Node id -> what running the adapter adds to its cost, for the nodes that can run it."""
        if self.lora_costs is None:
            return {}
        costs = ((n.node_id, self.lora_costs(n, lora_name)) for n in nodes)
        return {node_id: cost for node_id, cost in costs if cost is not None}

    def _skipping(self) -> bool:
        now = time.monotonic()
        if now >= self._skip_until:
            return False
        # The registry answers again: Redis is back, no need to sit out the rest of a long pause.
        return self.discovery.registry_error is not None or now < self._failed_at + _SKIP_MIN_S

    async def _lookup(self, hashes: list[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        if self.index is None or self._skipping():
            return {}
        try:
            if self._lookup_is_async:
                result = await asyncio.wait_for(self.index.lookup(hashes, nodes), self.lookup_timeout_s)
            else:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvrelay-index")
                call = asyncio.get_running_loop().run_in_executor(self._pool, self.index.lookup, hashes, nodes)
                result = await asyncio.wait_for(call, self.lookup_timeout_s)
        except Exception as e:  # route without cache knowledge rather than fail the request
            self._lookup_failed(e)
            return {}
        if self.index_error is not None:
            logger.info("index lookups work again")
        self.index_error, self._skip_s = None, _SKIP_MIN_S
        return result

    def _lookup_failed(self, e: Exception) -> None:
        reason = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {self.lookup_timeout_s:g}s"
        if self.index_error is None:
            logger.warning("index lookup failed, routing without prefix information for %.0fs: %s", self._skip_s,
                           reason)
        self.index_error = reason
        self._failed_at = time.monotonic()
        self._skip_until = self._failed_at + self._skip_s
        self._skip_s = min(self._skip_s * 2, _SKIP_MAX_S)
        if self.metrics is not None:
            self.metrics.index_errors.labels("lookup").inc()

    def decide(self, prompt_token_ids: Sequence[int], hashes: list[bytes], hits: dict[str, int],
               prefill_nodes: list[Node], decode_nodes: list[Node], start: float | None = None,
               user: str | None = None, extra_costs: dict[str, float] | None = None,
               tier_hits: TierHits | None = None) -> RouteDecision:
        """Score and pick; pure given its inputs (the benchmark times it without a network). `extra_costs`: what
        each node's cost gains beyond cache and load (a LoRA adapter's residency); `tier_hits`: the lookups that
        `tier_lookups` asked for (None: the tiers are not seen)."""
        start = time.perf_counter() if start is None else start
        n = len(prompt_token_ids)
        session = None if not user else b"user\x00" + user.encode()
        prompt = Prompt(n, _affinity_key(prompt_token_ids, hashes), self.local_prefill_threshold,
                        can_disaggregate=bool(prefill_nodes), session_key=session, block_hashes=hashes)
        decode = self.policy.rank("decode", self._candidates(decode_nodes, hits, n, extra_costs, tier_hits), prompt)
        best = decode[0]
        prefill: list[Candidate] = []
        if not decode_is_local(best, prompt):
            prefill = self.policy.rank("prefill", self._candidates(prefill_nodes, hits, n, extra_costs, tier_hits),
                                       prompt)
        fleet_cached = max(hits.values(), default=0) * self.block_size
        return RouteDecision(
            decode=best.node, prefill=prefill[0].node if prefill else None, num_prompt_tokens=n,
            decode_cached_tokens=best.cached_tokens, prefill_cached_tokens=prefill[0].cached_tokens if prefill else 0,
            decode_fallbacks=tuple(c.node for c in decode[1:]), prefill_fallbacks=tuple(c.node for c in prefill[1:]),
            seconds=time.perf_counter() - start, fleet_cached_tokens=min(fleet_cached, max(n - 1, 0)),
        )

    def _candidates(self, nodes: list[Node], hits: dict[str, int], num_tokens: int,
                    extra_costs: dict[str, float] | None = None, tier_hits: TierHits | None = None
                    ) -> list[Candidate]:
        if extra_costs or tier_hits is not None:
            out = self._candidates(nodes, hits, num_tokens)
            for c in out:
                if extra_costs:
                    c.extra_cost = extra_costs.get(c.node.node_id, 0.0)
                if tier_hits is not None and c.node.kv_tiers:
                    self._add_tier(c, hits, tier_hits, num_tokens)
            return out
        seqs, tokens, bs = self.inflight.seqs, self.inflight.prefill_tokens, self.block_size
        # A full-prompt hit still leaves the last token to compute (the engine needs its logits).
        cap = max(num_tokens - 1, 0)
        cached = hits.get
        # Runs for every node of every request: conditionals, not min/max calls; no in-flight lookups when
        # this gateway has nothing in flight.
        if not seqs and not tokens:
            return [Candidate(node, c if (c := cached(node.node_id, 0) * bs) < cap else cap) for node in nodes]
        return [Candidate(node, c if (c := cached(node.node_id, 0) * bs) < cap else cap,
                          seqs.get(node.node_id, 0), tokens.get(node.node_id, 0)) for node in nodes]

    def _add_tier(self, c: Candidate, hits: dict[str, int], tier_hits: TierHits, num_tokens: int) -> None:
        end, _ = tier_walk(c.node, hits, tier_hits, num_tokens // self.block_size)
        total = min(end * self.block_size, max(num_tokens - 1, 0))
        if total > c.cached_tokens:
            c.tier_tokens = total - c.cached_tokens
            c.cached_tokens = total

    # ----------------------------------------------------------------------------------- in-flight

    def track_sequence(self, node_id: str) -> Count:
        return Count(self.inflight.seqs, node_id, 1)

    def track_prefill(self, node_id: str, num_tokens: int) -> Count:
        return Count(self.inflight.prefill_tokens, node_id, num_tokens)


def sees_tiers(hits: dict[str, int], nodes: Sequence[Node]) -> bool:
    """Whether the tiers can change a decision: the index holds some of the prompt and a candidate has a tier.
    When not, `decide` gets no tier hits and the candidates' hot path stays as it is without tiers."""
    return bool(hits) and any(n.kv_tiers for n in nodes)


def tier_walk(node: Node, hits: dict[str, int], tier_hits: TierHits, num_blocks: int) -> tuple[int, bool]:
    """Where the node's cached prefix ends (in blocks): its resident run, then its tiers' runs, each from where
    the one before ended. And whether a lookup there is wanted: a run ended in one of two or more tiers, or
    nothing was looked up yet from there."""
    end, tiers = hits.get(node.node_id, 0), node.kv_tiers
    while end < num_blocks:
        runs = hits if end == 0 else tier_hits.get(end)
        if runs is None:
            return end, True
        blocks = max(runs.get(t, 0) for t in tiers)
        if not blocks:
            break
        end += blocks
        if len(tiers) < 2:  # one tier's run ends where that tier lacks the block
            break
    return end, False


def tier_lookups(hashes: Sequence[bytes], hits: dict[str, int], tier_hits: TierHits, nodes: Sequence[Node]
                 ) -> dict[int, set[str]]:
    """The lookups the nodes' tiers want beyond `hits` and `tier_hits`: from this block on -> the tier entries to
    look up there (`tier_walk`). At most what `_MAX_TIER_LOOKUPS` leaves, for the longest prefixes."""
    out: dict[int, set[str]] = {}
    for node in nodes:
        if node.kv_tiers:
            end, wanted = tier_walk(node, hits, tier_hits, len(hashes))
            if wanted:
                out.setdefault(end, set()).update(node.kv_tiers)
    room = _MAX_TIER_LOOKUPS - len(tier_hits)
    if len(out) > room:
        out = {k: out[k] for k in sorted(out)[len(out) - room:]}
    return out


def _affinity_key(prompt_token_ids: Sequence[int], hashes: list[bytes]) -> bytes:
    if hashes:
        return hashes[min(len(hashes), _AFFINITY_BLOCKS) - 1]
    return xxhash.xxh3_128_digest(repr(list(prompt_token_ids)).encode())


async def wait_for_nodes(discovery: Discovery, timeout_s: float) -> bool:
    """Until a decode node is routable (start-up), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not discovery.routable("decode"):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
