"""The engine's side of the KV offload tier: blocks leave the KV cache into the host's store when the pool
evicts them, and come back instead of being recomputed when a prompt's next blocks are found there.

Lifecycle of a block through the tier:
1. Evicted: the block pool reuses a cached block's slot (`BlockPool.get_new_blocks`) and names it to
   `offload(ids, hashes)` before anything writes into it. Its bytes are copied out on the engine thread (a
   memcpy) and written to the store by a writer thread, in batches, without holding up the step.
2. Found: when a request arrives, `prefetch` has a reader thread read and checksum-verify the blocks of its
   prompt past the resident prefix that the store has, while the engine steps. At admission
   `KVCacheManager.get_computed_blocks` asks `fetch(hashes)` how many of them the store has: those the reader
   staged count at once, the others are read now. Counted blocks stay staged, so a block counted as a hit can no
   longer fail: whatever fails is a miss, and the tokens are computed.
3. Loaded: `allocate_slots` gives the hit's new blocks to `load(ids, hashes)`, which copies the staged bytes
   into them; they are then hashed and cached like computed blocks.

Keys: an xxh3-64 of the namespace (the KV layout: model and weights' form, dtype, block size, layers, heads, head
size; and the weight files), then the block hash in hex (which chains the cache salt, adapter and KV dtype), so no
block is ever found for another layout, and a folder's listing names the blocks of a namespace.
The scheduler only ever sees counts and ids; tensors stay behind `BlockIO` (the model runner).

Routing sees the tier (`publish_to`): each tier of the store is one entry in the block index (`tier_ids`: the
same id on every node of the host that names the folder and runs the namespace). The writer thread lists the
folder after each write and every `interval_s`, and sends what appeared and went since its last listing, whoever
wrote or evicted it, as STORED/EVICTED events (a snapshot when the index asks for one) to that tier's sink.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import xxhash

from kvrelay.common.records import BlockEvent, BlockEventKind, BlockHash
from kvrelay.engine.block_pool import BlockEventSink
from kvrelay.engine.offload.store import Buffer, DirTier, TieredStore, TierStats

logger = logging.getLogger(__name__)

_FORMAT = b"kvrelay-offload-2\x00"
_LIST = object()  # a writer-queue item: list the tiers' folders for the index now
_RATE_MIN_TOKENS = 64  # a step this large is mostly prompt: it measures a computed token's cost


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
    prefetched_blocks: int = 0  # read and verified ahead of their request's admission, off the engine thread
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
    token_cost: float = 0.0  # KVOffload.token_cost


class KVOffload:
    """`namespace`: what every key starts with (offload.namespace); `block_bytes`: a block's payload, of
    `block_size` tokens;
    `max_staged_bytes`: read ahead of their load at most (a prompt loads at most that much of its prefix);
    `max_pending_bytes`: evicted bytes waiting for the writer at most (more are dropped, counted)."""

    def __init__(self, store: TieredStore, namespace: str, io: BlockIO, block_bytes: int, block_size: int = 16,
                 max_staged_bytes: int = 256 << 20, max_pending_bytes: int = 256 << 20) -> None:
        self.store = store
        self._block_size = block_size
        self._compute_s_per_token: float | None = None
        self.io = io
        self.stats = OffloadStats()
        self._prefix = _FORMAT + namespace.encode()
        self._key_prefix = xxhash.xxh3_64_hexdigest(self._prefix) + "-"
        self._sinks: dict[DirTier, BlockEventSink] = {}  # publish_to: each tier's index entries
        self._views: dict[DirTier, set[BlockHash]] = {}  # what each sink was last told its tier holds
        self._list_every: float | None = None  # seconds between listings when no write comes (None: no index)
        # Blocks read and verified ahead of their load, at most `_max_staged` when a fetch starts (twice that while
        # it runs). The reader thread only adds (under the lock); the engine thread alone takes out, and trims only
        # before it counts, so a block `fetch` counted is still there for `load`.
        self._staged: OrderedDict[BlockHash, Buffer] = OrderedDict()
        self._staged_lock = threading.Lock()
        self._reads: dict[BlockHash, concurrent.futures.Future] = {}  # prefetches under way (engine thread only)
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvrelay-offload-read")
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
            TierReport(t.name, replace(t.stats), t.used, t.capacity, t.enabled) for t in self.store.tiers),
            self.token_cost())

    def key(self, block_hash: BlockHash) -> str:
        return self._key_prefix + block_hash.hex()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's forward took `seconds` for `num_tokens` tokens: steps of at least `_RATE_MIN_TOKENS` (prompt
        chunks) measure what computing a token costs, against which `token_cost` weighs a load."""
        if num_tokens >= _RATE_MIN_TOKENS:
            rate = seconds / num_tokens
            self._compute_s_per_token = rate if self._compute_s_per_token is None else (
                0.9 * self._compute_s_per_token + 0.1 * rate)

    def token_cost(self) -> float:
        """What loading a prompt token from the tier costs as a fraction of computing it, as measured on this
        engine: the engine thread's time per loaded block (reading and verifying it, the lookups that missed
        included, copying it in) over a computed token's share of a prompt step. 0.0 until both are measured."""
        s, compute = self.stats, self._compute_s_per_token
        if not s.loaded_blocks or not compute:
            return 0.0
        per_token = (s.fetch_seconds + s.load_seconds) / (s.loaded_blocks * self._block_size)
        return min(1.0, per_token / compute)

    # -- the block index: routing sees the tier ------------------------------------------------------------
    def tier_ids(self) -> dict[str, str]:
        """Each tier's id in the block index, by tier name: one id for every node of this host that names the
        tier's folder and runs this namespace, so they keep one set of entries that any of them can load."""
        host = socket.gethostname()
        return {t.name: f"tier:{t.name}:" + xxhash.xxh3_64_hexdigest(f"{host}|{t.path.resolve()}|".encode()
                                                                     + self._prefix) for t in self.store.tiers}

    def publish_to(self, sinks: Mapping[str, BlockEventSink], interval_s: float = 1.0) -> None:
        """From now on, keep `sinks[tier name]` told what the tier holds of this namespace: the writer thread lists
        the folder after each write and every `interval_s`, and sends the blocks that appeared and went since the
        last listing (or all of them, when the sink wants a snapshot). Call once, before the first offload."""
        self._sinks = {t: sinks[t.name] for t in self.store.tiers if t.name in sinks}
        self._views = {t: set() for t in self._sinks}
        self._list_every = interval_s if self._sinks else None
        self._queue.put(_LIST)

    def _publish_tiers(self) -> None:
        """Writer thread: list each published tier's folder and tell its sink what changed."""
        for tier, sink in self._sinks.items():
            try:
                now = self._listed(tier.keys(self._key_prefix))
            except FileNotFoundError:  # the folder was removed: so were its blocks
                now = set()
            except OSError:  # unreadable for now: keep the last view
                continue
            old = self._views[tier]
            try:
                if sink.snapshot_wanted:
                    sink.submit_snapshot(list(now))
                elif now != old:
                    sink.submit([BlockEvent(BlockEventKind.EVICTED, h) for h in old - now]
                                + [BlockEvent(BlockEventKind.STORED, h) for h in now - old])
            except Exception:  # noqa: BLE001 - the index is soft state: the tier goes on without it
                logger.exception("offload: publishing the %s tier's blocks failed", tier.name)
                continue
            self._views[tier] = now

    def _listed(self, keys: list[str]) -> set[BlockHash]:
        n, out = len(self._key_prefix), set()
        for key in keys:
            try:
                block_hash = bytes.fromhex(key[n:])
            except ValueError:  # not a name this code wrote
                continue
            if len(block_hash) == 16:
                out.add(block_hash)
        return out

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
            try:
                item = self._queue.get(timeout=self._list_every)
            except queue.Empty:  # a quiet while: other nodes of the host may have written or evicted
                item = _LIST
            if item is None:
                return
            if item is _LIST:
                self._publish_tiers()
                continue
            size, batch = item
            while True:  # everything queued so far goes in one locked pass over the directory
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                if more is not _LIST:  # listed after this write anyway
                    size += more[0]
                    batch.extend(more[1])
            try:
                self.store.write(batch)
            except Exception:  # noqa: BLE001 - the tier is an optimisation: serving goes on without it
                logger.exception("offload: writing %d blocks failed", len(batch))
            self._written(size)
            if self._sinks:
                self._publish_tiers()

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
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._queue.put(None)
        self._writer.join(timeout=10.0)

    # -- in: prefix hits -----------------------------------------------------------------------------
    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """A request arrived (engine thread): a reader thread starts reading and verifying these blocks, in order up
        to the first the store lacks, so that `fetch` finds them staged. Within the staging bound; a hint only."""
        self._reads = {h: f for h, f in self._reads.items() if not f.done()}  # a request that never came to fetch
        room = self._max_staged - len(self._staged) - len(self._reads)
        todo = [h for h in hashes[: max(room, 0)] if h not in self._reads and h not in self._staged]
        if todo:
            future = self._reader.submit(self._read_ahead, todo)
            for h in todo:
                self._reads[h] = future

    def _read_ahead(self, hashes: list[BlockHash]) -> None:
        """Reader thread: it only adds to the staged blocks; the engine thread alone takes them out."""
        for block_hash in hashes:
            try:
                found = self.store.read(self.key(block_hash))
            except Exception:  # noqa: BLE001 - a read ahead that fails is a read `fetch` does itself
                logger.exception("offload: reading a block ahead failed")
                return
            if found is None:
                return
            with self._staged_lock:
                self._staged[block_hash] = found[0]
                self.stats.prefetched_blocks += 1

    def fetch(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the store has, read and verified (kept staged for `load`)."""
        n = 0
        t0 = time.perf_counter()
        with self._staged_lock:  # trimmed before counting: what this call counts stays until its load
            while len(self._staged) > self._max_staged:
                self._staged.popitem(last=False)
        for block_hash in hashes[: self._max_staged]:
            self.stats.lookups += 1
            ahead = self._reads.pop(block_hash, None)
            if ahead is not None:  # a read of it is under way: wait for it rather than read it twice
                ahead.result()
            with self._staged_lock:
                staged = block_hash in self._staged
                if staged:
                    self._staged.move_to_end(block_hash)
            if not staged:
                found = self.store.read(self.key(block_hash))
                if found is None:
                    break
                with self._staged_lock:
                    self._staged[block_hash] = found[0]
            self.stats.hits += 1
            n += 1
        self.stats.fetch_seconds += time.perf_counter() - t0
        return n

    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Copy staged blocks (from the `fetch` that counted them) into the KV cache's `block_ids`."""
        t0 = time.perf_counter()
        with self._staged_lock:
            payloads = [self._staged.pop(h) for h in hashes]
        self.io.write_blocks(block_ids, payloads)
        self.stats.loaded_blocks += len(block_ids)
        self.stats.load_seconds += time.perf_counter() - t0
