"""Per-request block tables on top of the block pool, with prefix-cache lookups.

Lifecycle of a request's blocks:
1. Admission: `get_computed_blocks` finds the longest cached prefix (whole blocks, hash-chained), and past it
   the blocks the offload tier holds (`PrefixTier`, kvrelay.engine.offload), when there is one.
2. `allocate_slots` takes references on the hit blocks and allocates new ones for the tokens scheduled
   this step (the tier's blocks are loaded into the first of them); blocks that become full get their hash
   (so later requests hit them).
3. Each later step `allocate_slots` grows the table as tokens are added. A block another request also
   references (a beam's fork) is copied before this request writes into it (copy-on-write): the copy
   is queued for the runner (`drain_block_copies`) and the table changes in place (`rewritten`).
4. Speculative decoding: `trim` gives back the blocks past the tokens that survived verification.
5. `free` (finish, abort or preemption) drops the references, tail first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvrelay.common.hashing import hash_blocks, lora_extra_keys, root_hash
from kvrelay.common.records import BlockHash
from kvrelay.engine.block_pool import BlockPool, KVBlock
from kvrelay.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixHit:
    """Resident blocks, then `loaded`: hashes of the blocks past them the tier holds; `num_tokens` covers both."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int
    loaded: tuple[BlockHash, ...] = ()


class PrefixTier(Protocol):
    """A tier below the KV cache (kvrelay.engine.offload.tier.KVOffload): how many of these blocks it has (ready to
    load, so the count cannot fail later), and their loading into the blocks allocated for them."""

    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """A hint, when a request arrives: start reading these blocks ahead of `fetch`, off the engine thread."""

    def fetch(self, hashes: Sequence[BlockHash]) -> int: ...

    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None: ...


NO_HIT = PrefixHit((), 0)


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        model_id: str,
        enable_caching: bool = True,
        kv_dtype: str = "",
        tier: PrefixTier | None = None,
    ) -> None:
        self.pool = pool
        self.tier = tier
        self.block_size = block_size
        self.model_id = model_id
        self.kv_dtype = kv_dtype  # a quantized KV cache's dtype ("": the model's), part of every block hash
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request already carry their hash.
        self.num_cached_blocks: dict[str, int] = {}
        self._roots: dict[str, bytes] = {}
        self.held: dict[str, list[KVBlock]] = {}
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner, in order
        self.rewritten: set[str] = set()  # requests whose table changed other than by appending

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of its known tokens."""
        done = len(req.block_hashes)
        if (done + 1) * self.block_size > req.num_tokens:
            return
        parent = req.block_hashes[-1] if done else self._root(req.cache_salt)
        req.block_hashes.extend(hash_blocks(req.all_token_ids, self.block_size, parent, start_block=done,
                                            extra_keys=lora_extra_keys(req.lora_name), images=req.images))

    def _root(self, salt: str) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_hash(self.model_id, self.block_size, salt, self.kv_dtype)
        return root

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        if not self.enable_caching:
            return NO_HIT
        hit, rest = self._resident(req)
        loaded: tuple[BlockHash, ...] = ()
        if self.tier is not None and rest:
            loaded = tuple(rest[: self.tier.fetch(rest)])
        return PrefixHit(tuple(hit), (len(hit) + len(loaded)) * self.block_size, loaded)

    def prefetch(self, req: Request) -> None:
        """A request arrived: the tier starts reading the blocks past its resident prefix now, off the engine thread,
        so that its admission finds them read (admission reads whatever is not read by then)."""
        if self.tier is not None and self.enable_caching:
            _, rest = self._resident(req)
            if rest:
                self.tier.prefetch(rest)

    def _resident(self, req: Request) -> tuple[list[KVBlock], Sequence[BlockHash]]:
        """The cached blocks of the prompt's longest resident prefix, and the hashes of its full blocks past it."""
        self.update_block_hashes(req)
        # At least one token must be computed to produce logits, so a full hit gives back its last block.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, req.block_hashes[len(hit):max_blocks]

    def blocks_to_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT,
                           num_lookahead_tokens: int = 0) -> int:
        """Free blocks `allocate_slots` with the same arguments would take (new ones, hit blocks revived from
        the free queue, copies of shared ones)."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + hit.num_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new = max(0, num_required - len(blocks) - len(hit.blocks))
        shared = self._shared_write_targets(blocks, num_computed, num_computed + num_new_tokens)
        return num_new + sum(1 for b in hit.blocks if b.ref_cnt == 0) + len(shared)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT, cache: bool = True,
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (and the hit), plus
        `num_lookahead_tokens` slots past them (a draft model's KV for its proposals), or None when the
        pool cannot supply them (nothing is changed then). `cache=False` leaves the new blocks unhashed:
        their KV arrives later (a transfer), and `cache_tokens` hashes them then."""
        rid = req.request_id
        blocks = self.req_to_blocks.get(rid, [])
        if num_new_tokens == 1 and not num_lookahead_tokens and not hit.num_tokens and blocks:
            # Most calls (every decode row of every step): one token into the last block the request holds on
            # its own. Nothing to take from the pool or copy; at most that block filled up and gets its hash.
            pos = req.num_computed_tokens
            last = len(blocks) - 1
            if pos // self.block_size == last and blocks[last].ref_cnt == 1:
                if cache and self.num_cached_blocks.get(rid, 0) * self.block_size <= pos + 1 - self.block_size:
                    self._cache_full_blocks(req, pos + 1)
                return []
        num_computed = req.num_computed_tokens + hit.num_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new = max(0, num_required - len(blocks) - len(hit.blocks))
        shared = self._shared_write_targets(blocks, num_computed, num_computed + num_new_tokens)
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_revived = sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit.blocks else 0
        if num_new + num_revived + len(shared) > self.pool.num_free_blocks:
            return None
        if shared:
            self._copy_on_write(req.request_id, blocks, shared)
        if hit.blocks:
            self.pool.touch(hit.blocks)
        # Most calls are a decode's next token, inside a block it already has: nothing to take from the pool.
        new_blocks = self.pool.get_new_blocks(num_new) if num_new else []
        if hit.loaded:
            self.tier.load([b.block_id for b in new_blocks[: len(hit.loaded)]], hit.loaded)
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        if hit.blocks:
            blocks.extend(hit.blocks)
            self.num_cached_blocks[req.request_id] = len(blocks)
        blocks.extend(new_blocks)
        if cache:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return new_blocks

    def _shared_write_targets(self, blocks: list[KVBlock], start: int, end: int) -> list[int]:
        """Indexes of this table's blocks that positions [start, end) write into and another table shares."""
        first, last = start // self.block_size, min(cdiv(end, self.block_size), len(blocks))
        if last - first == 1:  # a decode's one token (every request of every step): no list to build
            return [first] if blocks[first].ref_cnt > 1 else []
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def _copy_on_write(self, request_id: str, blocks: list[KVBlock], indexes: list[int]) -> None:
        for i, fresh in zip(indexes, self.pool.get_new_blocks(len(indexes))):
            old = blocks[i]
            self._copies.append((old.block_id, fresh.block_id))
            blocks[i] = fresh  # unhashed: a shared block is written only while partial
            self.pool.free_blocks([old])
        self.rewritten.add(request_id)

    def drain_block_copies(self) -> tuple[tuple[int, int], ...]:
        copies, self._copies = tuple(self._copies), []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (one more reference each) and its block hashes."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def trim(self, req: Request, num_tokens: int) -> bool:
        """Give back the blocks past the first `num_tokens` slots (they held rejected drafts); True if any."""
        blocks = self.req_to_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return False
        tail = blocks[keep:]
        del blocks[keep:]
        num_cached = self.num_cached_blocks.get(req.request_id, 0)
        for block in tail[: max(0, num_cached - keep)]:
            self.pool.uncache_block(block)
        self.num_cached_blocks[req.request_id] = min(num_cached, keep)
        self.pool.free_blocks(reversed(tail))
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        # Only tokens whose ids are known can be hashed: a step's last token is known, the next is not.
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(req)
        blocks = self.req_to_blocks[req.request_id]
        self.pool.cache_blocks(blocks[start:num_full], req.block_hashes[start:num_full])
        self.num_cached_blocks[req.request_id] = num_full

    def cache_tokens(self, req: Request) -> None:
        """Hash blocks filled by tokens that became known after their slots were allocated."""
        self._cache_full_blocks(req, req.num_computed_tokens)

    def free(self, req: Request) -> None:
        self.rewritten.discard(req.request_id)
        blocks = self.req_to_blocks.pop(req.request_id, [])
        num_cached = self.num_cached_blocks.pop(req.request_id, 0)
        # Blocks hashed for tokens scheduled but never computed (a request preempted in the very step that
        # scheduled it) must not stay findable by their hash.
        for block in blocks[req.num_computed_tokens // self.block_size : num_cached]:
            self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))

    def hold(self, req: Request) -> None:
        """Keep a finished request's blocks (a transfer may still be reading them) until `release`."""
        self.held[req.request_id] = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)

    def release(self, request_id: str) -> bool:
        blocks = self.held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free_blocks(reversed(blocks))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def holds(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)


def ids(blocks: Sequence[KVBlock]) -> tuple[int, ...]:
    return tuple(b.block_id for b in blocks)
