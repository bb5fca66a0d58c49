"""The block index in Redis (docs/architecture.md, "Index").

Layout, all keys of a model under the hash tag `kvr:{<model_id>}:` (one cluster slot per model):

    kvr:{m}:b:<hash hex>   STRING  bitmap over node slots: bit s is set <=> the node in slot s holds the block
    kvr:{m}:n:<node_id>    SET     hex hashes the node holds (so a dead node's entries can be purged)
    kvr:{m}:slots          HASH    node_id -> slot: the known nodes of the model
    kvr:{m}:owners         HASH    slot -> node_id, and v: a version bumped whenever a slot changes hands
    kvr:{m}:free           ZSET    freed slots, lowest reused first (keeps bitmaps short)
    kvr:{m}:next_slot      STRING  slot counter
    kvr:{m}:reg:<node_id>  HASH    {reg, load} JSON under the node's lease (TTL); see registry.py
    kvr:{m}:events         STREAM  every change of the block keys, in order: {s: sequence number, n: node id,
                                   r: records ('+' stored / '-' removed, then 32 hex chars)}; capped
    kvr:{m}:seq            STRING  the last sequence number given to an event

The scripts that change block keys (apply, clear) append what they changed to the events stream in the same
atomic call, with the next sequence number: a gateway's in-process mirror (mirror.py) follows the stream,
and a gap in the numbers tells it that it missed something (the stream is capped, Redis restarted).

The block key is the set of nodes holding the block, stored as a bitmap over small per-model node slots
rather than a Redis SET of ids: the lookup walks up to 256 blocks for 100 nodes, and a bitmap makes that an
MGET plus byte ANDs, with consecutive blocks held by the same nodes compared as one interned Lua string.
A SET walk (SMISMEMBER of the still-matching nodes per block) is several times slower (`kvrelay bench
index-lookup --compare-set` times both), and a bitmap of 100 nodes is 13 bytes, against ~100+ of a small SET.

Slots are assigned and freed only inside scripts, atomically with the bits: a bit is set for slot s only
while s belongs to a node whose per-node SET lists the hash, and a slot is freed only when that SET is
empty. A writer therefore never needs to cache its slot, and a purged node that writes again simply
gets a (maybe different) slot, which `apply` reports so the node can resync.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.index.base import HASH_LEN, BlockIndex, IndexUnavailable, check_block_hashes

log = logging.getLogger(__name__)

LOOKUP_CHUNK = 32  # blocks per MGET: bounds wasted reads once every node has stopped matching
CLEAR_BATCH = 1000  # hashes per clear step: keeps each script call short (Redis runs one at a time)
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class Keys:
    """Key names of one model (see the module docstring)."""

    def __init__(self, model_id: str) -> None:
        self.prefix = f"kvr:{{{model_id}}}:"
        self.block_prefix = self.prefix + "b:"
        self.reg_prefix = self.prefix + "reg:"
        self.slots = self.prefix + "slots"
        self.owners = self.prefix + "owners"
        self.free = self.prefix + "free"
        self.next_slot = self.prefix + "next_slot"
        self.seq = self.prefix + "seq"
        self.events = self.prefix + "events"

    def block(self, block_hash: bytes) -> str:
        return self.block_prefix + block_hash.hex()

    def node(self, node_id: str) -> str:
        return self.prefix + "n:" + node_id

    def reg(self, node_id: str) -> str:
        return self.reg_prefix + node_id

    def slot_keys(self) -> list[str]:
        return [self.slots, self.owners, self.free, self.next_slot]

    def event_keys(self) -> list[str]:
        return [self.seq, self.events]


# Entries the events stream keeps (approximately): a follower further behind than this reloads a snapshot.
STREAM_MAXLEN = 10_000


# Prepended to scripts that may give a node its slot. KEYS: slots, owners, free, next_slot.
SLOT_FN = """
local function node_slot(node)
  local s = redis.call('HGET', KEYS[1], node)
  if s then return tonumber(s), 0 end
  local popped = redis.call('ZPOPMIN', KEYS[3])
  if popped[1] then s = tonumber(popped[1]) else s = redis.call('INCR', KEYS[4]) - 1 end
  redis.call('HSET', KEYS[1], node, s)
  redis.call('HSET', KEYS[2], s, node)
  redis.call('HINCRBY', KEYS[2], 'v', 1)
  return s, 1
end
local function emit(seq_key, stream, maxlen, node, recs)
  local seq = redis.call('INCR', seq_key)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 's', seq, 'n', node, 'r', recs)
end
local function unset_bit(key, s)
  if redis.call('GETBIT', key, s) == 1 then
    redis.call('SETBIT', key, s, 0)
    if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
  end
end
"""

# KEYS: owners, block keys in prompt order. ARGV: the caller's owners version and node mask (a bitmap over
# slots), both '' for no filter. Returns {owners version, records}: records packed as (byte position, bits,
# count) big-endian '>HBI', one per bitmap byte of nodes that stopped at the same block; or {version} alone
# when the mask was built from another version (slots moved). Nodes are kept as (byte, bits) pairs.
LOOKUP_LUA = """
local band, byte, pack = bit.band, string.byte, struct.pack
local ver = redis.call('HGET', KEYS[1], 'v') or '0'
if ARGV[1] ~= '' and ARGV[1] ~= ver then return {ver} end
local n = #KEYS - 1
local first = redis.call('GET', KEYS[2])
if not first then return {ver, ''} end
local mask = ARGV[2]
local pos, act, na = {}, {}, 0
for p = 1, #first do
  local v = byte(first, p)
  if ARGV[1] ~= '' then v = band(v, byte(mask, p) or 0) end
  if v ~= 0 then na = na + 1; pos[na] = p; act[na] = v end
end
local out = {}
local matched, prev = 1, first
while na > 0 and matched < n do
  local hi = math.min(matched + CHUNK, n)
  local maps = redis.call('MGET', unpack(KEYS, matched + 2, hi + 1))
  for k = 1, #maps do
    local m = maps[k]
    -- Same bitmap as the previous block: every still-active node holds this one too.
    if m ~= prev then
      local w = 0
      for q = 1, na do
        local a, v = act[q], 0
        if m then v = band(a, byte(m, pos[q]) or 0) end
        if v ~= a then out[#out + 1] = pack('>HBI', pos[q], a - v, matched) end
        if v ~= 0 then w = w + 1; pos[w] = pos[q]; act[w] = v end
      end
      na, prev = w, m
      if na == 0 then break end
    end
    matched = matched + 1
  end
end
for q = 1, na do out[#out + 1] = pack('>HBI', pos[q], act[q], matched) end
return {ver, table.concat(out)}
""".replace("CHUNK", str(LOOKUP_CHUNK))

# KEYS: slots, owners, free, next_slot, node set, seq, events. ARGV: node_id, block key prefix, records ('+'
# stored or '-' evicted, then 32 hex chars; concatenated), stream cap. Returns 1 when the node had no slot
# (new or purged). The records go to the events stream as they are.
APPLY_LUA = (
    SLOT_FN
    + """
local slot, fresh = node_slot(ARGV[1])
local bp, recs, nodeset = ARGV[2], ARGV[3], KEYS[5]
local run, runkind = {}, nil
local function flush()
  if #run > 0 then redis.call(runkind == '+' and 'SADD' or 'SREM', nodeset, unpack(run)); run = {} end
end
for off = 1, #recs, 33 do
  local kind, h = string.sub(recs, off, off), string.sub(recs, off + 1, off + 32)
  if kind ~= runkind or #run >= 1000 then flush(); runkind = kind end
  if kind == '+' then redis.call('SETBIT', bp .. h, slot, 1) else unset_bit(bp .. h, slot) end
  run[#run + 1] = h
end
flush()
emit(KEYS[6], KEYS[7], ARGV[4], ARGV[1], recs)
return fresh
"""
)

# KEYS: slots, owners, free, next_slot, node set, reg key, seq, events. ARGV: node_id, block key prefix,
# batch size, '1' to clear only while the node is unregistered (the janitor: a node that came back keeps
# its entries), stream cap. Returns the number of hashes left, or -1 when skipped. Frees the slot once
# empty, unless registered. The removed hashes go to the events stream as '-' records.
CLEAR_LUA = (
    SLOT_FN
    + """
local registered = redis.call('EXISTS', KEYS[6]) == 1
if ARGV[4] == '1' and registered then return -1 end
local s = redis.call('HGET', KEYS[1], ARGV[1])
local hashes = redis.call('SPOP', KEYS[5], tonumber(ARGV[3]))
if s then
  for _, h in ipairs(hashes) do unset_bit(ARGV[2] .. h, s) end
end
if #hashes > 0 then emit(KEYS[7], KEYS[8], ARGV[5], ARGV[1], '-' .. table.concat(hashes, '-')) end
local left = redis.call('SCARD', KEYS[5])
if left == 0 and s and not registered then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], s)
  redis.call('HINCRBY', KEYS[2], 'v', 1)
  redis.call('ZADD', KEYS[3], s, s)
end
return left
"""
)


# Slot offsets of the set bits of a bitmap byte; bit 0 is the byte's most significant bit (SETBIT order).
_BIT_SLOTS = [tuple(b for b in range(8) if byte & (0x80 >> b)) for byte in range(256)]
_RECORD = struct.Struct(">HBI")


@dataclass(frozen=True)
class SlotMap:
    """The owners hash at one version: slot -> node id, and back."""

    version: bytes
    owners: dict[int, str]
    slots: dict[str, int]

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> SlotMap:
        version = raw.pop(b"v", b"0")
        owners = {int(k): v.decode() for k, v in raw.items()}
        return cls(version, owners, {v: k for k, v in owners.items()})

    def mask(self, nodes: Collection[str]) -> bytes:
        slots = [self.slots[n] for n in nodes if n in self.slots]
        bits = bytearray(max(slots) // 8 + 1 if slots else 1)
        for s in slots:
            bits[s // 8] |= 0x80 >> (s % 8)
        return bytes(bits)

    def decode(self, records: bytes) -> dict[str, int]:
        out: dict[str, int] = {}
        for pos, bits, count in _RECORD.iter_unpack(records):
            base = (pos - 1) * 8
            for b in _BIT_SLOTS[bits]:
                node = self.owners.get(base + b)
                if node is not None:
                    out[node] = count
        return out


class RawConnection:
    """A lookup connection spoken to directly: redis-py's pool and reply parser cost ~60 us of CPU per call,
    more than packing and decoding together. redis-py still opens it (AUTH, SELECT, timeouts)."""

    def __init__(self, conn: redis.Connection) -> None:
        self.conn = conn

    def call(self, payload: bytes) -> list[bytes | None]:
        if self.conn._sock is None:
            self.conn.connect()
        sock = self.conn._sock
        sock.sendall(payload)
        buf = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                self.disconnect()
                raise redis.ConnectionError("connection closed by the server")
            buf += chunk
            reply = parse_bulk_array(buf)
            if reply is not None:
                return reply

    def disconnect(self) -> None:
        self.conn.disconnect()


def parse_bulk_array(buf: bytes) -> list[bytes | None] | None:
    """A RESP array of bulk strings (the lookup's only reply shape), or None while incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    if buf[:1] == b"-":
        message = buf[1:end].decode(errors="replace")
        if message.startswith("NOSCRIPT"):
            raise redis.exceptions.NoScriptError(message)
        raise redis.ResponseError(message)
    items: list[bytes | None] = []
    pos = end + 2
    for _ in range(int(buf[1:end])):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(buf[pos + 1 : end])
        start = end + 2
        if size < 0:
            items.append(None)
            pos = start
            continue
        if len(buf) < start + size + 2:
            return None
        items.append(buf[start : start + size])
        pos = start + size + 2
    return items


def connect(url: str, socket_timeout_s: float = 2.0) -> redis.Redis:
    """A client that fails fast: the callers (gateway, publisher thread) have their own fallback."""
    retry = Retry(NoBackoff(), 1)  # one reconnect covers a server restart
    return redis.Redis.from_url(
        url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, retry=retry
    )


def event_records(events: Sequence[BlockEvent]) -> str:
    return "".join(("+" if e.kind is BlockEventKind.STORED else "-") + e.block_hash.hex() for e in events)


def clear_node_entries(keys: Keys, script: Script, node_id: str, only_if_dead: bool) -> bool:
    """Clear in batches (each one atomic and short). Returns False when skipped: the node is registered."""
    args = [node_id, keys.block_prefix, CLEAR_BATCH, "1" if only_if_dead else "0", STREAM_MAXLEN]
    key_list = [*keys.slot_keys(), keys.node(node_id), keys.reg(node_id), *keys.event_keys()]
    while True:
        left = script(keys=key_list, args=args)
        if left < 0:
            return False
        if left == 0:
            return True


class RedisIndex(BlockIndex):
    def __init__(
        self,
        url: str,
        model_id: str,
        *,
        socket_timeout_s: float = 2.0,
        lookup_timeout_s: float = 0.5,
        lookup_retry_after_s: float = 1.0,
    ) -> None:
        self.url = url
        self.model_id = model_id
        self.keys = Keys(model_id)
        self.client = connect(url, socket_timeout_s)
        self._apply = self.client.register_script(APPLY_LUA)
        self._clear = self.client.register_script(CLEAR_LUA)
        self._lookup_sha = self.client.register_script(LOOKUP_LUA).sha
        self._local = threading.local()
        self._lookup_conns: list[RawConnection] = []
        self._lock = threading.Lock()
        # Round trips of apply(): the publisher's batching is tested against this, not a mock.
        self.num_write_round_trips = 0
        self._lookup_head = self._pack_lookup_head()
        self._owners = SlotMap(b"", {}, {})  # replaced whole (never mutated): readers need no lock
        # A gateway must not stall every request on a dead index: after a failure, fail fast for a while.
        self.lookup_timeout_s = lookup_timeout_s
        self.lookup_retry_after_s = lookup_retry_after_s
        self._down_until = 0.0

    # ---------------------------------------------------------------- lookup (the gateway's hot path)

    def _pack_lookup_head(self) -> tuple[bytes, bytes]:
        prefix = self.keys.block_prefix.encode()
        owners = self.keys.owners.encode()
        return b"$%d\r\n%s\r\n" % (len(owners), owners), b"$%d\r\n" % (len(prefix) + 2 * HASH_LEN) + prefix

    def _pack_lookup(self, block_hashes: Sequence[bytes], version: bytes, mask: bytes) -> bytes:
        """EVALSHA in RESP, built in a few joins: redis-py's generic packer costs ~250 us for 256 keys."""
        owners, key_head = self._lookup_head
        blocks = key_head + ("\r\n" + key_head.decode()).join([h.hex() for h in block_hashes]).encode() + b"\r\n"
        num_keys = 1 + len(block_hashes)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n" % (5 + num_keys, self._lookup_sha.encode())
        head += b"$%d\r\n%d\r\n" % (len(str(num_keys)), num_keys)
        tail = b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(version), version, len(mask), mask)
        return head + owners + blocks + tail

    def lookup(self, block_hashes: Sequence[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        check_block_hashes(block_hashes)  # a wrong length would corrupt the hand-packed request
        if not block_hashes or (nodes is not None and not nodes):
            return {}
        if time.monotonic() < self._down_until:
            raise IndexUnavailable(f"index at {self.url} failed recently; retrying after a pause")
        if nodes is not None and not self._owners.version:
            self._refresh_owners()  # the filter is sent as slots: the map must have been read once
        for _ in range(4):
            owners = self._owners
            version, mask = (owners.version, owners.mask(nodes)) if nodes is not None else (b"", b"")
            reply = self._roundtrip(self._pack_lookup(block_hashes, version, mask))
            if len(reply) == 2 and not reply[1]:
                return {}
            if reply[0] != owners.version:
                self._refresh_owners()  # a node joined or left since the slot map was read
                owners = self._owners
            if len(reply) == 2 and reply[0] == owners.version:
                return owners.decode(reply[1])
        raise IndexUnavailable("index lookup: node slots keep changing")

    def _refresh_owners(self) -> None:
        try:
            self._owners = SlotMap.parse(self.client.hgetall(self.keys.owners))
        except REDIS_ERRORS as exc:
            self._down_until = time.monotonic() + self.lookup_retry_after_s
            raise IndexUnavailable(f"index at {self.url}: {exc}") from exc

    def _roundtrip(self, payload: bytes) -> list:
        for attempt in range(3):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._new_lookup_conn()
            try:
                return conn.call(payload)
            except redis.exceptions.NoScriptError:
                self._refresh_script()  # the server restarted: its script cache is empty
            except REDIS_ERRORS as exc:
                conn.disconnect()
                if attempt >= 1:
                    self._down_until = time.monotonic() + self.lookup_retry_after_s
                    raise IndexUnavailable(f"index lookup at {self.url}: {exc}") from exc
        raise IndexUnavailable(f"index lookup at {self.url}: script cache keeps missing")

    # ---------------------------------------------------------------- writes (a node's publisher)

    def apply(self, node_id: str, events: Sequence[BlockEvent]) -> bool:
        if not events:
            return False
        key_list = [*self.keys.slot_keys(), self.keys.node(node_id), *self.keys.event_keys()]
        args = [node_id, self.keys.block_prefix, event_records(events), STREAM_MAXLEN]
        with self._lock:
            self.num_write_round_trips += 1
        try:
            return bool(self._apply(keys=key_list, args=args))
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"index write at {self.url}: {exc}") from exc

    def clear_node(self, node_id: str) -> None:
        try:
            clear_node_entries(self.keys, self._clear, node_id, only_if_dead=False)
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"index clear at {self.url}: {exc}") from exc

    def known_nodes(self) -> set[str]:
        try:
            return {n.decode() for n in self.client.hkeys(self.keys.slots)}
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"index at {self.url}: {exc}") from exc

    def node_hashes(self, node_id: str) -> set[bytes]:
        """The hashes the index lists for a node (for tests and debugging)."""
        return {bytes.fromhex(h.decode()) for h in self.client.smembers(self.keys.node(node_id))}

    def _new_lookup_conn(self) -> RawConnection:
        pool = self.client.connection_pool
        kwargs = {**pool.connection_kwargs, "socket_timeout": self.lookup_timeout_s}
        kwargs["socket_connect_timeout"] = self.lookup_timeout_s
        conn = RawConnection(pool.connection_class(**kwargs))
        with self._lock:
            self._lookup_conns.append(conn)
        return conn

    def _refresh_script(self) -> None:
        try:
            self.client.script_load(LOOKUP_LUA)
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"index at {self.url}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            conns, self._lookup_conns = self._lookup_conns, []
        for conn in conns:
            conn.disconnect()
        self.client.close()
