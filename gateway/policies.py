"""Routing policies: rank the candidate nodes of one role for one prompt, best first.

Costs are in prompt-token equivalents so cache hits and load compare directly:
- prefill node: the tokens it must compute (prompt minus its cached prefix), times `compute_weight`, plus the
  tokens queued ahead.
- decode node: with no prefill node up, the same; else, when it would prefill locally (a few tokens), those
  tokens plus its queue, and otherwise a small weight per token to transfer; plus a cost per sequence it is
  already decoding.
A token to compute counts twice (`compute_weight` 2): the request waits for it, and so does whatever queues
behind it at that node. Counted once, a gateway that sees its nodes' queues exactly (one gateway, its own
requests in flight) leaves a cached prefix for a shorter queue too readily, recomputes thousands of tokens
elsewhere, and near saturation that work is what the fleet lacks: on the llm-d shape at 8 nodes and 10 req/s,
TTFT p90 0.53 s against 0.17 s, and one gateway hit 5 points less of the prompt than eight sharing the index
(docs/fleet.md, Routing at scale).
A prefix the node would load from its host's offload tier instead of computing counts as cached, plus each
loaded token at the share of a computed token that the node measured (`tier_token_cost` when it has not yet): below
a resident token, above a miss.
Load is the larger of what the node last published and what this gateway has in flight there: the
published number lags, and the gateway's own count misses other replicas, so neither alone is right.

Ties are broken by rendezvous hashing on the prompt's leading blocks: the same prefix prefers the same node
in every gateway replica (no randomness, no shared state), and different prefixes spread out.

A request naming its `user` is a session: among the nodes whose cost is within `session_slack` of the best
(comparable loads), the one the user's rendezvous hash picks goes first, so a conversation keeps landing
where its earlier turns are cached even before the index has seen them; a clearly cheaper node still wins.

This runs for every request over every node (the benchmark: 100 nodes), so candidates are slotted objects
with their load folded in once, and rendezvous hashes are computed only among equal costs.

Policies (`make_policy` by name; `kvrelay sim` compares them at fleet scale, docs/fleet.md):
- cache_aware: the cost above, with each node's cached prefix from the block index (precise prefix routing);
- approximate: the same cost, with the cached prefix guessed from what this gateway itself routed (no index,
  like llm-d's approximate prefix scorer): blind to other gateways, to evictions, and to its own past after a
  restart;
- least_loaded: load only; round_robin: each node in turn; random: a seeded random node first.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

import xxhash

from kvrelay.gateway.discovery import Node

_FIRST = itemgetter(0)


@dataclass(frozen=True)
class Weights:
    compute_weight: float = 2.0  # a token to compute: the request's wait, and the same for whoever queues behind
    transfer_per_token: float = 0.05  # moving a block costs far less than computing it
    per_running_seq: float = 32.0  # one more sequence in a decode batch, in prompt tokens
    kv_full_penalty: float = 1e9  # a node that cannot hold the prompt goes last, but stays a fallback
    session_slack: float = 64.0  # how much costlier than the best a session's own node may be and still win
    tier_token_cost: float = 0.1  # a token loaded from an offload tier, as a share of computing it (until measured)


class Candidate:
    """A node as one request sees it: its cached prefix (`tier_tokens` of it in an offload tier, to load) and its
    load (published or in flight, the larger)."""

    __slots__ = ("node", "cached_tokens", "tier_tokens", "queued_tokens", "active_seqs", "extra_cost")

    def __init__(self, node: Node, cached_tokens: int, inflight: int = 0, inflight_tokens: int = 0,
                 tier_tokens: int = 0) -> None:
        self.node = node
        self.cached_tokens = cached_tokens
        self.tier_tokens = tier_tokens
        self.extra_cost = 0.0  # what else running the request here costs (a LoRA adapter to load), in tokens
        queued, active = node.queued_tokens, node.active_seqs
        self.queued_tokens = queued if queued >= inflight_tokens else inflight_tokens
        self.active_seqs = active if active >= inflight else inflight

    def fits(self, num_tokens: int) -> bool:
        free = self.node.free_tokens
        # Loaded blocks take room like computed ones. None: unknown, let the node decide.
        return free is None or free >= num_tokens - self.cached_tokens + self.tier_tokens


@dataclass(frozen=True)
class Prompt:
    num_tokens: int
    affinity_key: bytes  # identifies the prompt's leading blocks, for tie-breaks
    local_threshold: int  # a decode node prefills itself when it would compute at most this many tokens
    can_disaggregate: bool  # a prefill node is up
    session_key: bytes | None = None  # the request's `user`, when it gave one
    block_hashes: Sequence[bytes] = ()  # the prompt's full blocks' chained hashes (policies that keep their own)


def rendezvous(key: bytes, node_id: str) -> int:
    # Smallest wins; independent of the order and number of nodes, so adding a node moves few prefixes.
    return xxhash.xxh3_64_intdigest(key + node_id.encode())


def decode_is_local(c: Candidate, prompt: Prompt) -> bool:
    return not prompt.can_disaggregate or prompt.num_tokens - c.cached_tokens <= prompt.local_threshold


def order_by_cost(scored: list[tuple[float, Candidate]], key: bytes) -> list[Candidate]:
    """Ascending cost; equal costs in rendezvous order."""
    scored.sort(key=_FIRST)
    out: list[Candidate] = []
    for _, group in itertools.groupby(scored, key=_FIRST):
        tied = [c for _, c in group]
        if len(tied) > 1:
            tied.sort(key=lambda c: rendezvous(key, c.node.node_id))
        out.extend(tied)
    return out


class Policy(ABC):
    name = "base"
    uses_cache = False

    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = weights or Weights()

    @abstractmethod
    def rank(self, role: str, candidates: list[Candidate], prompt: Prompt) -> list[Candidate]:
        """The candidates best first; the rest of the order is the fallback sequence."""


class CostPolicy(Policy):
    """Ranks by a per-role cost, lowest first (ties in rendezvous order)."""

    def rank(self, role: str, candidates: list[Candidate], prompt: Prompt) -> list[Candidate]:
        cost = self.prefill_cost if role == "prefill" else self.decode_cost
        scored = [(cost(c, prompt) + c.extra_cost, c) for c in candidates]
        ranked = order_by_cost(scored, prompt.affinity_key)
        if prompt.session_key is None or len(ranked) < 2:
            return ranked
        limit = scored[0][0] + self.weights.session_slack  # order_by_cost sorted `scored` in place
        band = [c for cost_, c in scored if cost_ <= limit]
        home = min(band, key=lambda c: rendezvous(prompt.session_key, c.node.node_id))
        return [home, *(c for c in ranked if c is not home)]

    @abstractmethod
    def prefill_cost(self, c: Candidate, prompt: Prompt) -> float: ...

    @abstractmethod
    def decode_cost(self, c: Candidate, prompt: Prompt) -> float: ...


class CacheAware(CostPolicy):
    name = "cache_aware"
    uses_cache = True

    def prefill_cost(self, c: Candidate, prompt: Prompt) -> float:
        w = self.weights
        return w.compute_weight * (prompt.num_tokens - c.cached_tokens + self.loading(c)) + c.queued_tokens

    def decode_cost(self, c: Candidate, prompt: Prompt) -> float:
        w = self.weights
        uncached = prompt.num_tokens - c.cached_tokens
        if not decode_is_local(c, prompt):
            work = w.transfer_per_token * uncached + self.loading(c)
        elif prompt.can_disaggregate:  # a few tokens computed here, weighed against a transfer, not a queue
            work = uncached + self.loading(c) + c.queued_tokens
        else:  # every decode node computes the prompt itself: compute against queue, as on prefill nodes
            work = w.compute_weight * (uncached + self.loading(c)) + c.queued_tokens
        penalty = 0.0 if c.fits(prompt.num_tokens) else w.kv_full_penalty
        return work + w.per_running_seq * c.active_seqs + penalty

    def loading(self, c: Candidate) -> float:
        """The candidate's tier tokens to load, in computed-token equivalents."""
        if not c.tier_tokens:
            return 0.0
        cost = c.node.tier_token_cost
        return c.tier_tokens * (self.weights.tier_token_cost if cost is None else cost)


class LeastLoaded(CostPolicy):
    name = "least_loaded"

    def prefill_cost(self, c: Candidate, prompt: Prompt) -> float:
        return c.queued_tokens

    def decode_cost(self, c: Candidate, prompt: Prompt) -> float:
        return self.weights.per_running_seq * c.active_seqs + c.queued_tokens


class RoundRobin(Policy):
    """Each role's nodes in turn, sorted by node id; the rest of the order is the fallback sequence."""

    name = "round_robin"

    def __init__(self, weights: Weights | None = None) -> None:
        super().__init__(weights)
        self._counters = {"prefill": itertools.count(), "decode": itertools.count()}

    def rank(self, role: str, candidates: list[Candidate], prompt: Prompt) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.node.node_id)
        if not ordered:
            return ordered
        start = next(self._counters[role]) % len(ordered)
        return ordered[start:] + ordered[:start]


class RandomChoice(Policy):
    """A random node first (seeded: the same seed picks the same sequence); the others follow in id order."""

    name = "random"

    def __init__(self, weights: Weights | None = None, seed: int | None = None) -> None:
        super().__init__(weights)
        self._rng = random.Random(seed)

    def rank(self, role: str, candidates: list[Candidate], prompt: Prompt) -> list[Candidate]:
        ordered = sorted(candidates, key=lambda c: c.node.node_id)
        if not ordered:
            return ordered
        start = self._rng.randrange(len(ordered))
        return ordered[start:] + ordered[:start]


class ApproximatePrefix(CacheAware):
    """Cache-aware cost, with the cached prefix guessed from this gateway's own routing instead of the index.

    Each node has an LRU of the block hashes this gateway routed to it, as many as the node's KV cache holds
    (from its published load; `default_blocks` until it has published one). A candidate's cached prefix is the
    leading run of the prompt's blocks in its LRU. Never asks the index: `uses_cache` is False."""

    name = "approximate"
    uses_cache = False

    def __init__(self, weights: Weights | None = None, default_blocks: int = 65536) -> None:
        super().__init__(weights)
        self.default_blocks = default_blocks
        self._routed: dict[str, OrderedDict[bytes, None]] = {}

    def rank(self, role: str, candidates: list[Candidate], prompt: Prompt) -> list[Candidate]:
        hashes = prompt.block_hashes
        if hashes:
            cap = max(prompt.num_tokens - 1, 0)
            for c in candidates:
                n = self._leading(c.node.node_id, hashes) * c.node.block_size
                c.cached_tokens = n if n < cap else cap
        ranked = super().rank(role, candidates, prompt)
        if ranked and hashes:
            self._remember(ranked[0].node, hashes)
        return ranked

    def _leading(self, node_id: str, hashes: Sequence[bytes]) -> int:
        routed = self._routed.get(node_id)
        if not routed:
            return 0
        n = 0
        for h in hashes:
            if h not in routed:
                break
            n += 1
        return n

    def _remember(self, node: Node, hashes: Sequence[bytes]) -> None:
        routed = self._routed.get(node.node_id)
        if routed is None:
            routed = self._routed[node.node_id] = OrderedDict()
        for h in hashes:
            routed[h] = None
            routed.move_to_end(h)
        load = node.load
        limit = load.total_kv_blocks if load is not None and load.total_kv_blocks else self.default_blocks
        while len(routed) > limit:
            routed.popitem(last=False)

    def forget(self) -> None:
        """Drop everything remembered (what a restarted gateway knows)."""
        self._routed.clear()


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (CacheAware, ApproximatePrefix, LeastLoaded, RoundRobin, RandomChoice)}


def make_policy(name: str, weights: Weights | None = None, seed: int | None = None) -> Policy:
    """The policy of this name; `seed` seeds the random one (None: from the system)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"routing_policy: unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(weights, seed) if cls is RandomChoice else cls(weights)
