"""Node registry and load (docs/architecture.md, "Registry and load").

A node's registration and its last load live in one HASH, `kvr:{<model>}:reg:<node_id>` = {reg, load} (JSON),
whose TTL is the node's lease. Registering also gives the node its slot in the model's known nodes
(`kvr:{m}:slots`, see redis_index.py), so `live_nodes` is one script: the known nodes whose lease holds.

A `Heartbeat` thread renews the lease every ttl/3 with fresh load, and every few beats runs the janitor,
`purge_dead_nodes`, which clears the index entries of known nodes whose lease lapsed: a crashed node's
entries are gone about one TTL (plus a few beats) after its last heartbeat. A renewal that finds its own
lease lapsed (a long pause, or a Redis restart) re-creates it and calls `on_lapse`, so the node's
publisher resyncs whatever the janitor may have purged meanwhile.

Node start-up order: clear the node's old entries, register, then publish (the IndexPublisher does the
clear first); shutdown: stop the publisher, `deregister`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kvrelay.common.records import NodeLoad
from kvrelay.index.base import (
    IndexUnavailable,
    LiveNode,
    NodeRegistration,
    RegistryBackend,
    role_matches,
    spare_named_tiers,
)
from kvrelay.index.redis_index import CLEAR_LUA, REDIS_ERRORS, SLOT_FN, Keys, clear_node_entries, connect

log = logging.getLogger(__name__)

__all__ = ["Registry"]

# KEYS: slots, owners, free, next_slot, reg key. ARGV: node_id, reg JSON, load JSON or '', ttl ms.
# Returns 1 when a live lease existed.
REGISTER_LUA = (
    SLOT_FN
    + """
local existed = redis.call('EXISTS', KEYS[5])
node_slot(ARGV[1])
redis.call('HSET', KEYS[5], 'reg', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[5], 'load', ARGV[3]) end
redis.call('PEXPIRE', KEYS[5], ARGV[4])
return existed
"""
)

# KEYS: slots. ARGV: reg key prefix, '1' for the live nodes' {reg, load} pairs or '0' for the dead ids.
NODES_LUA = """
local out = {}
for _, node in ipairs(redis.call('HKEYS', KEYS[1])) do
  local v = redis.call('HMGET', ARGV[1] .. node, 'reg', 'load')
  if ARGV[2] == '1' then
    if v[1] then out[#out + 1] = v[1]; out[#out + 1] = v[2] or '' end
  elseif not v[1] then
    out[#out + 1] = node
  end
end
return out
"""


class Registry(RegistryBackend):
    def __init__(self, url: str, *, socket_timeout_s: float = 2.0) -> None:
        self.url = url
        self.client = connect(url, socket_timeout_s)
        self._register = self.client.register_script(REGISTER_LUA)
        self._nodes = self.client.register_script(NODES_LUA)
        self._clear = self.client.register_script(CLEAR_LUA)
        self._models: dict[str, str] = {}  # node_id -> model_id of what this client registered

    def register(self, reg: NodeRegistration, ttl_s: float, load: NodeLoad | None = None) -> bool:
        keys = Keys(reg.model_id)
        ttl_ms = max(1, int(ttl_s * 1000))
        args = [reg.node_id, reg.to_json(), load.to_json() if load else "", ttl_ms]
        self._models[reg.node_id] = reg.model_id
        try:
            return bool(self._register(keys=[*keys.slot_keys(), keys.reg(reg.node_id)], args=args))
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"registry at {self.url}: {exc}") from exc

    def deregister(self, node_id: str, model_id: str | None = None) -> None:
        remembered = self._models.pop(node_id, None)
        model_id = model_id or remembered
        if model_id is None:
            raise KeyError(f"deregister: unknown model of node {node_id!r}; pass model_id")
        keys = Keys(model_id)
        try:
            self.client.delete(keys.reg(node_id))
            clear_node_entries(keys, self._clear, node_id, only_if_dead=False)
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"registry at {self.url}: {exc}") from exc

    def live_nodes(self, model_id: str, role: str | Collection[str] | None = None) -> list[LiveNode]:
        keys = Keys(model_id)
        try:
            flat = self._nodes(keys=[keys.slots], args=[keys.reg_prefix, "1"])
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"registry at {self.url}: {exc}") from exc
        out: list[LiveNode] = []
        for raw_reg, raw_load in zip(flat[::2], flat[1::2]):
            try:
                reg = NodeRegistration.from_json(raw_reg)
                load = NodeLoad.from_json(raw_load) if raw_load else None
            except (ValueError, TypeError) as exc:  # a malformed entry must not hide the other nodes
                log.warning("skipping malformed registration in %s: %s", model_id, exc)
                continue
            if role_matches(reg.role, role):
                out.append((reg, load))
        out.sort(key=lambda rl: rl[0].node_id)
        return out

    def purge_dead_nodes(self, model_id: str) -> list[str]:
        keys = Keys(model_id)
        try:
            dead = [n.decode() for n in self._nodes(keys=[keys.slots], args=[keys.reg_prefix, "0"])]
            dead = spare_named_tiers(dead, lambda: self.live_nodes(model_id))
            # Each clear step re-checks the lease: a node that re-registers meanwhile keeps its entries.
            purged = [n for n in dead if clear_node_entries(keys, self._clear, n, only_if_dead=True)]
        except REDIS_ERRORS as exc:
            raise IndexUnavailable(f"registry at {self.url}: {exc}") from exc
        if purged:
            log.info("purged index entries of dead nodes %s (model %s)", purged, model_id)
        return purged

    def close(self) -> None:
        self.client.close()
