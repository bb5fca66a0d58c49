"""A node in the registry and the block index (shared/index). Without --redis-url it runs unregistered.

Registration lifecycle (the order shared/index/registry.py asks for):
1. Clear what an earlier life of this node id left in the index.
2. Register (id, role, addresses, model, block size, capacity) under a TTL lease, with the current load;
   a heartbeat thread renews it every --heartbeat-seconds with fresh load from the engine's snapshot.
3. An IndexPublisher takes the block pool's STORED/EVICTED events, which the engine thread hands over
   after every step, and writes them from its own thread. If the lease lapsed (the janitor may have purged
   our entries) or a write failed, it resyncs from a snapshot of the cached hashes, taken on the engine
   thread.
4. On graceful shutdown: stop the heartbeat, flush and stop the publisher, deregister (which also drops
   the node's index entries).
Redis being down never stops the node: start-up logs it and the heartbeat and publisher keep retrying.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SNAPSHOT_TIMEOUT_S = 30.0


@dataclass
class Registration:
    registry: object  # shared.index.registry.Registry
    index: object  # shared.index.redis_index.RedisIndex
    heartbeat: object  # shared.index.registry.Heartbeat
    publisher: object  # shared.index.publisher.IndexPublisher
    node_id: str
    model_id: str

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        from shared.index.base import IndexUnavailable

        self.heartbeat.stop()
        self.publisher.close(timeout_s=2.0)
        try:
            self.registry.deregister(self.node_id, self.model_id)
            logger.info("deregistered %s", self.node_id)
        except IndexUnavailable as e:
            logger.warning("could not deregister %s (its lease will lapse): %s", self.node_id, e)
        self.index.close()
        self.registry.close()


async def start_registration(args: argparse.Namespace, servicer) -> Registration | None:
    if not args.redis_url:
        logger.info("no --redis-url: running unregistered (reach this node by its address)")
        return None
    return await asyncio.to_thread(_start, args, servicer)


def _start(args: argparse.Namespace, servicer) -> Registration:
    from shared.index.base import IndexUnavailable, NodeRegistration
    from shared.index.publisher import IndexPublisher
    from shared.index.redis_index import RedisIndex
    from shared.index.registry import Heartbeat, Registry

    info, engine = servicer.node_info(), servicer.engine
    reg = NodeRegistration(
        node_id=info.node_id, role=info.role, grpc_address=info.grpc_address, kv_address=info.kv_address,
        connector=info.connector, model_id=info.model_id, block_size=info.block_size, dtype=info.dtype,
        capacity_tokens=info.capacity_tokens, metrics_address=info.metrics_address, started_at=time.time(),
    )
    index, registry = RedisIndex(args.redis_url, reg.model_id), Registry(args.redis_url)
    cleared = True
    try:
        index.clear_node(reg.node_id)
        registry.register(reg, args.registry_ttl, node_load(engine))
        logger.info("registered %s in %s (lease %.1fs)", reg.node_id, args.redis_url, args.registry_ttl)
    except IndexUnavailable as e:
        cleared = False
        logger.warning("registry unreachable at start, will keep trying: %s", e)
    publisher = IndexPublisher(index, reg.node_id, snapshot_fn=lambda: cached_hashes(engine),
                               clear_on_start=not cleared)
    engine.on_block_events = publisher.submit
    heartbeat = Heartbeat(registry, reg, args.registry_ttl, lambda: node_load(engine),
                          on_lapse=publisher.request_resync, interval_s=args.heartbeat_seconds).start()
    return Registration(registry, index, heartbeat, publisher, reg.node_id, reg.model_id)


def node_load(engine):
    from shared.index.base import NodeLoad

    load = engine.load()
    return NodeLoad(
        num_waiting=load.num_waiting, num_running=load.num_running, queued_prefill_tokens=load.queued_prefill_tokens,
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=load.total_kv_blocks, kv_cache_usage=load.kv_cache_usage,
        ts=time.time(),
    )


def cached_hashes(engine) -> list[bytes]:
    """The block hashes the engine's prefix cache holds now, read on the engine thread."""
    return engine.call_blocking(lambda core: list(core.kv.pool.cached), _SNAPSHOT_TIMEOUT_S)
