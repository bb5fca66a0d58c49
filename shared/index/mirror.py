"""An in-process mirror of one model's block index, for gateways: lookups without a network round trip.

Redis stays the shared, durable copy. Every change of the block keys is also appended, in the same atomic
script, to the model's events stream with the next sequence number (redis_index.py). The mirror follows
that stream on its own thread into a local map {block hash: bitmask of the nodes holding it}, and answers
"how long a prefix of this chain does each node hold" from it in microseconds.

Lifecycle:
1. `start()`: the follower thread loads a snapshot: the stream's last sequence number and entry id first,
   then every known node's set of hashes (read while events go on). Lookups raise IndexUnavailable until
   this first load is done (the router then routes without prefix hints).
2. It follows the stream from that entry (XREAD BLOCK, on its thread, never on an event loop) and applies
   each entry in order. Replaying the entries that raced with the snapshot is harmless: each record sets
   or clears one (node, block) bit, so the last record for a bit decides it, as in Redis.
3. A gap in the sequence numbers (the follower fell behind the stream's cap, or Redis restarted and
   numbers begin again) or a lost connection: reload a snapshot once Redis answers, then follow again.
   Meanwhile lookups keep answering from what the mirror holds: routing goes on while Redis is away.
4. `close()` stops the thread (within one XREAD block) and the connections.

Writes (`apply`, `clear_node`) are not the mirror's business: it forwards them to Redis, and sees their
effect when it reads the stream, like everyone else.
"""

from __future__ import annotations

import binascii
import collections
import itertools
import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import redis

from kvrelay.common.records import BlockEvent
from kvrelay.index.base import BlockIndex, IndexUnavailable, check_block_hashes
from kvrelay.index.redis_index import REDIS_ERRORS, RedisIndex, connect

log = logging.getLogger(__name__)

_SNAPSHOT_HEAD_LUA = """
local seq = redis.call('GET', KEYS[1]) or '0'
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if last[1] then return {seq, last[1][1]} end
return {seq, '0-0'}
"""
_RECORD = 33  # '+' or '-', then 32 hex chars
_HASH = 16  # bytes of a block hash
_PLUS, _MINUS = ord("+"), ord("-")


@dataclass
class MirrorState:
    """Block hash -> bitmask of holders; bit b is node names[b]. Replaced whole by a snapshot, changed in
    place by events (lookups take one reference and tolerate a change under way: it is a routing hint).
    `apply` takes the events stream's records; the fleet simulator (kvrelay.sim) feeds it the same records."""

    holders: dict[bytes, int] = field(default_factory=dict)
    names: list[str | None] = field(default_factory=list)
    bits: dict[str, int] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # blocks held, per bit

    def bit_of(self, node: str) -> int:
        bit = self.bits.get(node)
        if bit is None:
            free = [b for b, name in enumerate(self.names) if name is None]
            bit = free[0] if free else len(self.names)
            if bit == len(self.names):
                self.names.append(None)
                self.counts.append(0)
            self.names[bit], self.bits[node] = node, bit
        return bit

    def apply(self, node: str, records: bytes) -> int:
        """Apply one node's records, as the events stream holds them; returns how many changed the state."""
        # One hex decode for the whole batch (the signs are not hex digits): record i's hash is raw[16i:16i+16].
        raw = binascii.unhexlify(records.translate(None, b"+-"))
        signs = records[::_RECORD]
        if len(records) % _RECORD or len(raw) != len(signs) * _HASH:
            raise ValueError(f"index records from {node}: not a whole number of '+'/'-' and 32 hex digits")
        hashes = [raw[off : off + _HASH] for off in range(0, len(raw), _HASH)]
        return self.apply_changes(node, hashes, None if _MINUS not in signs else [s == _PLUS for s in signs])

    def apply_changes(self, node: str, hashes: Sequence[bytes], stored: Sequence[bool] | None = None) -> int:
        """Apply one node's changes: hashes[i] stored (stored[i], or every one when `stored` is None) or
        evicted. Returns how many changed the state. (`apply` decodes the stream's records into this; the
        fleet simulator hands a node's block events over directly.)"""
        bit = self.bit_of(node)
        flag, holders, changed, held_by = 1 << bit, self.holders, 0, self.counts[bit]
        get = holders.get
        if stored is None:  # a node's stores only: the common batch
            for h in hashes:
                held = get(h, 0)
                if not held & flag:
                    holders[h] = held | flag
                    changed += 1
            held_by += changed
        else:
            for h, store in zip(hashes, stored):
                held = get(h, 0)
                if store:
                    if not held & flag:
                        holders[h] = held | flag
                        held_by += 1
                        changed += 1
                elif held & flag:
                    if held == flag:
                        del holders[h]
                    else:
                        holders[h] = held & ~flag
                    held_by -= 1
                    changed += 1
        self.counts[bit] = held_by
        if not held_by:  # holds nothing: its bit may go to another node
            del self.bits[node]
            self.names[bit] = None
        return changed

    def mask(self, nodes: Collection[str]) -> int:
        mask = 0
        for node in nodes:
            bit = self.bits.get(node)
            if bit is not None:
                mask |= 1 << bit
        return mask

    def lookup(self, block_hashes: Sequence[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        """BlockIndex.lookup's answer from this map (block_hashes not empty)."""
        get, names = self.holders.get, self.names
        active = get(block_hashes[0], 0)
        if nodes is not None:
            active &= self.mask(nodes)
        out: dict[str, int] = {}
        if not active:
            return out
        matched = 1
        # Hundreds of blocks per prompt: their holders fetched by map, not one subscript and call per turn.
        for held in map(get, itertools.islice(block_hashes, 1, None), itertools.repeat(0)):
            if held & active != active:
                _name_bits(out, active & ~held, names, matched)
                active &= held
                if not active:
                    return out
            matched += 1
        _name_bits(out, active, names, matched)
        return out


class MirrorIndex(BlockIndex):
    def __init__(
        self, url: str, model_id: str, *, socket_timeout_s: float = 2.0, block_ms: int = 500, start: bool = True
    ) -> None:
        self.url = url
        self.model_id = model_id
        self.remote = RedisIndex(url, model_id, socket_timeout_s=socket_timeout_s)
        self.keys = self.remote.keys
        self.block_ms = block_ms
        self._client = connect(url, socket_timeout_s + block_ms / 1000)  # its own: XREAD blocks on it
        self._head = self._client.register_script(_SNAPSHOT_HEAD_LUA)
        self._state = MirrorState()
        self.seq = 0  # the last event applied
        self._last_id: bytes | str = "0-0"
        self._synced = False
        self.ready = threading.Event()  # the first snapshot is loaded
        self.error: str | None = None  # the last failure to reach Redis, None while following
        self.num_snapshots = 0
        self.num_events = 0  # stream entries applied
        self.num_gaps = 0
        self.lag_ms: collections.deque[float] = collections.deque(maxlen=100_000)  # entry written -> applied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"index-mirror-{model_id}", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        return self.ready.wait(timeout_s)

    def sync(self, timeout_s: float = 5.0) -> bool:
        """Wait until the mirror has applied every event Redis had when called (tests, benchmarks)."""
        target = int(self.remote.client.get(self.keys.seq) or 0)
        deadline = time.monotonic() + timeout_s
        while self.seq < target or not self._synced:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    # ---------------------------------------------------------------- lookup (the gateway's hot path)

    def lookup(self, block_hashes: Sequence[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        check_block_hashes(block_hashes)
        if not block_hashes or (nodes is not None and not nodes):
            return {}
        if not self.ready.is_set():
            raise IndexUnavailable(f"index mirror of {self.url}: not loaded yet ({self.error or 'loading'})")
        return self._state.lookup(block_hashes, nodes)

    # ---------------------------------------------------------------- what else a BlockIndex answers

    def apply(self, node_id: str, events: Sequence[BlockEvent]) -> bool:
        return self.remote.apply(node_id, events)

    def clear_node(self, node_id: str) -> None:
        self.remote.clear_node(node_id)

    def known_nodes(self) -> set[str]:
        return set(self._state.bits)

    def node_hashes(self, node_id: str) -> set[bytes]:
        """The hashes the mirror lists for a node (tests, debugging: a full scan)."""
        state = self._state
        bit = state.bits.get(node_id)
        if bit is None:
            return set()
        flag = 1 << bit
        return {h for h, held in list(state.holders.items()) if held & flag}

    def stats(self) -> dict:
        return {"seq": self.seq, "ready": self.ready.is_set(), "error": self.error, "events": self.num_events,
                "snapshots": self.num_snapshots, "gaps": self.num_gaps, "blocks": len(self._state.holders)}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.block_ms / 1000 + 5)
        self._client.close()
        self.remote.close()

    # ---------------------------------------------------------------- the follower thread

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                if not self._synced:
                    self._snapshot()
                self._follow()
                delay = 0.05
                if self.error is not None:
                    log.info("index mirror of %s: following again", self.model_id)
                    self.error = None
            except (*REDIS_ERRORS, redis.ResponseError) as exc:
                if self.error is None:
                    log.warning("index mirror of %s: Redis unreachable, routing from the mirror meanwhile: %s",
                                self.model_id, exc)
                self.error = f"{type(exc).__name__}: {exc}"
                self._synced = False  # Redis may have restarted: reload once it answers
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)

    def _snapshot(self) -> None:
        """Load every node's hashes as of at least the stream's last entry, then follow from that entry."""
        seq, last_id = self._head(keys=self.keys.event_keys())
        nodes = [n.decode() for n in self._client.hkeys(self.keys.slots)]
        pipe = self._client.pipeline(transaction=False)
        for node in nodes:
            pipe.smembers(self.keys.node(node))
        state = MirrorState()
        for node, hashes in zip(nodes, pipe.execute()):
            if hashes:
                state.apply(node, b"".join(b"+" + h for h in hashes))
        self._state, self.seq, self._last_id = state, int(seq), last_id
        self._synced = True
        self.num_snapshots += 1
        self.ready.set()
        log.info("index mirror of %s: snapshot of %d nodes, %d blocks at event %d", self.model_id,
                 len(state.bits), len(state.holders), self.seq)

    def _follow(self) -> None:
        reply = self._client.xread({self.keys.events: self._last_id}, count=1000, block=self.block_ms)
        for _, entries in reply or ():
            for entry_id, fields in entries:
                seq = int(fields[b"s"])
                if seq != self.seq + 1:
                    self.num_gaps += 1
                    log.warning("index mirror of %s: event %d follows %d; reloading a snapshot",
                                self.model_id, seq, self.seq)
                    self._synced = False
                    return
                self._state.apply(fields[b"n"].decode(), fields[b"r"])
                self.seq, self._last_id = seq, entry_id
                self.num_events += 1
                self.lag_ms.append(time.time() * 1000 - int(entry_id.split(b"-")[0]))


def _name_bits(out: dict[str, int], bits: int, names: list[str | None], count: int) -> None:
    while bits:
        low = bits & -bits
        name = names[low.bit_length() - 1]
        if name is not None:
            out[name] = count
        bits ^= low
