"""The engine's side of the KV offload tier: blocks leave the KV cache into the host's store when the pool
evicts them, and come back instead of being recomputed when a prompt's next blocks are found there.

Lifecycle of a block through the tier:
1. Evicted: the block pool reuses a cached block's slot (`BlockPool.get_new_blocks`) and names it to
   `offload(ids, hashes)` before anything writes into it. Its bytes are copied out on the engine thread (a
   memcpy) and written to the store by a writer thread, in batches, without holding up the step.
2. Found: `KVCacheManager.get_computed_blocks` asks `fetch(hashes)` how many of the prompt's blocks past the
   resident hit the store has. Those are read and checksum-verified now and kept staged, so a block counted as
   a hit can no longer fail: whatever fails is a miss, and the tokens are computed.
3. Loaded: `allocate_slots` gives the hit's new blocks to `load(ids, hashes)`, which copies the staged bytes
   into them; they are then hashed and cached like computed blocks.

Keys: xxh3-128 of the KV layout (model and weights' form, dtype, block size, layers, heads, head size) and the
block hash (which chains the cache salt, adapter and KV dtype), so no block is ever found for another layout.
The scheduler only ever sees counts and ids; tensors stay behind `BlockIO` (the model runner).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import xxhash

from kvrelay.common.records import BlockHash
from kvrelay.engine.offload.store import Buffer, TieredStore, TierStats

logger = logging.getLogger(__name__)

_FORMAT = b"kvrelay-offload-1\x00"


class BlockIO(Protocol):
    """What the tier needs of the KV cache (the model runner): a block's bytes out, and in."""

    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]: ...

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[Buffer]) -> None: ...


@dataclass
class OffloadStats:
    """Cumulative counts of this engine's use of the tier (the store's tiers count their own files)."""

    offloaded_blocks: int = 0
    dropped_blocks: int = 0  # evicted while the writer was too far behind: not kept
    loaded_blocks: int = 0
    lookups: int = 0  # blocks looked for past a resident hit
    hits: int = 0
    # Engine-thread time: copying evicted blocks out, reading and verifying found ones, copying them in.
    offload_seconds: float = 0.0
    fetch_seconds: float = 0.0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class TierReport:
    name: str
    stats: TierStats
    used_bytes: int
    capacity: int
    enabled: bool


@dataclass(frozen=True)
class OffloadReport:
    """A snapshot for the metrics: this engine's counts, and each tier's."""

    stats: OffloadStats
    tiers: tuple[TierReport, ...]


class KVOffload:
    """`namespace`: what every key starts with (offload.namespace); `block_bytes`: a block's payload;
    `max_staged_bytes`: read ahead of their load at most (a prompt loads at most that much of its prefix);
    `max_pending_bytes`: evicted bytes waiting for the writer at most (more are dropped, counted)."""

    def __init__(self, store: TieredStore, namespace: str, io: BlockIO, block_bytes: int,
                 max_staged_bytes: int = 256 << 20, max_pending_bytes: int = 256 << 20) -> None:
        self.store = store
        self.io = io
        self.stats = OffloadStats()
        self._prefix = _FORMAT + namespace.encode()
        self._staged: OrderedDict[BlockHash, Buffer] = OrderedDict()
        self._block_bytes = block_bytes
        self._max_staged = max(1, max_staged_bytes // block_bytes)
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_loop, name="kvrelay-offload", daemon=True)
        self._writer.start()

    def report(self) -> OffloadReport:
        return OffloadReport(replace(self.stats), tuple(
            TierReport(t.name, replace(t.stats), t.used, t.capacity, t.enabled) for t in self.store.tiers))

    def key(self, block_hash: BlockHash) -> str:
        return xxhash.xxh3_128_hexdigest(self._prefix + block_hash)

    # -- out: eviction -------------------------------------------------------------------------------
    def offload(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Copy evicted blocks out (engine thread, before their slots are written) and queue them for the store;
        nothing is copied when the writer is too far behind or no tier takes writes any more."""
        size = len(block_ids) * self._block_bytes
        with self._lock:
            if self._pending_bytes + size > self._max_pending or not self.store.writable:
                self.stats.dropped_blocks += len(block_ids)
                return
            self._pending_bytes += size
            self._idle.clear()
        t0 = time.perf_counter()
        try:
            payloads = self.io.read_blocks(block_ids)
        except Exception:  # noqa: BLE001 - an optimisation never fails the allocation that evicted them
            logger.exception("offload: copying %d evicted blocks out failed; they are not kept", len(block_ids))
            self._written(size)
            self.stats.dropped_blocks += len(block_ids)
            return
        self.stats.offload_seconds += time.perf_counter() - t0
        self.stats.offloaded_blocks += len(block_ids)
        self._queue.put((size, [(self.key(h), p) for h, p in zip(hashes, payloads)]))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            size, batch = item
            while True:  # everything queued so far goes in one locked pass over the directory
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                size += more[0]
                batch.extend(more[1])
            try:
                self.store.write(batch)
            except Exception:  # noqa: BLE001 - the tier is an optimisation: serving goes on without it
                logger.exception("offload: writing %d blocks failed", len(batch))
            self._written(size)

    def _written(self, size: int) -> None:
        """`size` bytes queued for the writer are off its hands (written, or given up)."""
        with self._lock:
            self._pending_bytes -= size
            if self._pending_bytes == 0 and self._queue.empty():
                self._idle.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block is written (tests; shutdown)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=10.0)

    # -- in: prefix hits -----------------------------------------------------------------------------
    def fetch(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the store has, read and verified (kept staged for `load`)."""
        n = 0
        t0 = time.perf_counter()
        for block_hash in hashes[: self._max_staged]:
            self.stats.lookups += 1
            if block_hash in self._staged:
                self._staged.move_to_end(block_hash)
            else:
                found = self.store.read(self.key(block_hash))
                if found is None:
                    break
                self._staged[block_hash] = found[0]
                while len(self._staged) > self._max_staged:
                    self._staged.popitem(last=False)
            self.stats.hits += 1
            n += 1
        self.stats.fetch_seconds += time.perf_counter() - t0
        return n

    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Copy staged blocks (from the `fetch` that counted them) into the KV cache's `block_ids`."""
        t0 = time.perf_counter()
        self.io.write_blocks(block_ids, [self._staged.pop(h) for h in hashes])
        self.stats.loaded_blocks += len(block_ids)
        self.stats.load_seconds += time.perf_counter() - t0
