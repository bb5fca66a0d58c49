"""Routing policies: rank the candidate nodes of one role for one prompt, best first.

Costs are in prompt-token equivalents so cache hits and load compare directly:
- prefill node: the tokens it must compute (prompt minus its cached prefix) plus the tokens queued ahead.
- decode node: when it would prefill locally, the tokens it must compute plus its queue; otherwise a small
  weight per token to transfer, plus a cost per sequence it is already decoding.
Load is the larger of what the node last published and what this gateway has in flight there: the
published number lags, and the gateway's own count misses other replicas, so neither alone is right.

Ties are broken by rendezvous hashing on the prompt's leading blocks: the same prefix prefers the same node
in every gateway replica (no randomness, no shared state), and different prefixes spread out.

A request naming its `user` is a session: among the nodes whose cost is within `session_slack` of the best
(comparable loads), the one the user's rendezvous hash picks goes first, so a conversation keeps landing
where its earlier turns are cached even before the index has seen them; a clearly cheaper node still wins.

This runs for every request over every node (the benchmark: 100 nodes), so candidates are slotted objects
with their load folded in once, and rendezvous hashes are computed only among equal costs.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from operator import itemgetter

import xxhash

from kvrelay.gateway.discovery import Node

_FIRST = itemgetter(0)


@dataclass(frozen=True)
class Weights:
    transfer_per_token: float = 0.05  # moving a block costs far less than computing it
    per_running_seq: float = 32.0  # one more sequence in a decode batch, in prompt tokens
    kv_full_penalty: float = 1e9  # a node that cannot hold the prompt goes last, but stays a fallback
    session_slack: float = 64.0  # how much costlier than the best a session's own node may be and still win


class Candidate:
    """A node as one request sees it: its cached prefix and its load (published or in flight, the larger)."""

    __slots__ = ("node", "cached_tokens", "queued_tokens", "active_seqs")

    def __init__(self, node: Node, cached_tokens: int, inflight: int = 0, inflight_tokens: int = 0) -> None:
        self.node = node
        self.cached_tokens = cached_tokens
        queued, active = node.queued_tokens, node.active_seqs
        self.queued_tokens = queued if queued >= inflight_tokens else inflight_tokens
        self.active_seqs = active if active >= inflight else inflight

    def fits(self, num_tokens: int) -> bool:
        free = self.node.free_tokens
        return free is None or free >= num_tokens - self.cached_tokens  # None: unknown, let the node decide


@dataclass(frozen=True)
class Prompt:
    num_tokens: int
    affinity_key: bytes  # identifies the prompt's leading blocks, for tie-breaks
    local_threshold: int  # a decode node prefills itself when it would compute at most this many tokens
    can_disaggregate: bool  # a prefill node is up
    session_key: bytes | None = None  # the request's `user`, when it gave one


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
        scored = [(cost(c, prompt), c) for c in candidates]
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
        return prompt.num_tokens - c.cached_tokens + c.queued_tokens

    def decode_cost(self, c: Candidate, prompt: Prompt) -> float:
        w = self.weights
        uncached = prompt.num_tokens - c.cached_tokens
        work = uncached + c.queued_tokens if decode_is_local(c, prompt) else w.transfer_per_token * uncached
        penalty = 0.0 if c.fits(prompt.num_tokens) else w.kv_full_penalty
        return work + w.per_running_seq * c.active_seqs + penalty


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


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (CacheAware, LeastLoaded, RoundRobin)}


def make_policy(name: str, weights: Weights | None = None) -> Policy:
    try:
        return POLICIES[name](weights)
    except KeyError:
        raise ValueError(f"routing_policy: unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
