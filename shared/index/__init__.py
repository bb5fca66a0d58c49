"""The block index and node registry (docs/architecture.md, "Index" and "Registry and load").

    index = create_index("unix:///run/kvrelay/redis.sock?db=0", model_id)   # or redis://host:6379/0
    index.lookup(prompt_block_hashes(...))          # {node_id: leading blocks held}, one round trip
    mirror = create_index(url, model_id, backend="mirror")   # the same answers from an in-process copy
    publisher = IndexPublisher(index, node_id, snapshot_fn=...); publisher.submit(pool.drain_events())
    registry = create_registry(url); registry.register(reg, ttl_s=10)
    Heartbeat(registry, reg, 10, load_fn, on_lapse=publisher.request_resync).start()

Backends (INDEX_BACKENDS): "redis" (redis://, rediss://, unix:// URLs: a round trip per lookup), "mirror"
(a Redis URL: follows the index's events stream into an in-process copy and looks up locally; gateways)
and "memory" ("memory" or "memory://<name>"), an in-process store with the same semantics for unit tests;
backends with the same memory name share it. The backend defaults to the URL's.
"""

from __future__ import annotations

from kvrelay.index.base import (
    BlockIndex,
    IndexUnavailable,
    LiveNode,
    NodeRegistration,
    RegistryBackend,
)
from kvrelay.index.heartbeat import Heartbeat
from kvrelay.index.publisher import IndexPublisher

__all__ = [
    "INDEX_BACKENDS",
    "BlockIndex",
    "Heartbeat",
    "IndexPublisher",
    "IndexUnavailable",
    "LiveNode",
    "NodeRegistration",
    "RegistryBackend",
    "backend_of",
    "create_index",
    "create_registry",
]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def backend_of(url_or_name: str) -> str:
    """The backend of a URL or name: "redis" or "memory"; ValueError for anything else."""
    if url_or_name.startswith(REDIS_SCHEMES):
        return "redis"
    if url_or_name == "memory" or url_or_name.startswith("memory://"):
        return "memory"
    raise ValueError(f"index: expected a redis://, rediss://, unix:// URL or 'memory', got {url_or_name!r}")


INDEX_BACKENDS = ("redis", "mirror", "memory")


def create_index(
    url_or_name: str, model_id: str, *, backend: str | None = None, socket_timeout_s: float = 2.0
) -> BlockIndex:
    store = backend_of(url_or_name)
    backend = backend or store
    if backend not in INDEX_BACKENDS:
        raise ValueError(f"index backend: {backend!r}; choose one of {', '.join(INDEX_BACKENDS)}")
    if store == "memory":  # already in process: a mirror of it would be itself
        from kvrelay.index.memory import MemoryIndex, get_store

        return MemoryIndex(get_store(url_or_name), model_id)
    if backend == "memory":
        raise ValueError(f"index backend 'memory' takes 'memory' or 'memory://<name>', not {url_or_name!r}")
    if backend == "mirror":
        from kvrelay.index.mirror import MirrorIndex

        return MirrorIndex(url_or_name, model_id, socket_timeout_s=socket_timeout_s)
    from kvrelay.index.redis_index import RedisIndex

    return RedisIndex(url_or_name, model_id, socket_timeout_s=socket_timeout_s)


def create_registry(url_or_name: str, *, socket_timeout_s: float = 2.0) -> RegistryBackend:
    if backend_of(url_or_name) == "memory":
        from kvrelay.index.memory import MemoryRegistry, get_store

        return MemoryRegistry(get_store(url_or_name))
    from kvrelay.index.registry import Registry

    return Registry(url_or_name, socket_timeout_s=socket_timeout_s)
