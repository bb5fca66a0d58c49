"""A node in the registry and the block index (shared/index). Without a Redis URL it runs unregistered.

Registration lifecycle:
1. `open_publisher` (before the engine thread exists, so the engine is built with it as its block-event
   sink): an IndexPublisher for this node id, not started yet.
2. `start_registration`: clear what an earlier life of this node id left in the index, register (id, role,
   addresses, model, block size, capacity) under a TTL lease with the current load, start the publisher,
   and a heartbeat thread that renews the lease every `heartbeat_s` with fresh load. A lapsed lease (the
   janitor may have purged our entries) or a failed start makes the publisher ask the engine for a snapshot.
3. `Registration.stop()` on graceful shutdown: stop the heartbeat, flush and stop the publisher, deregister
   (which also drops the node's index entries).
With an offload tier, each tier's entry in the index ("tier:<name>:<id>", shared by the host's nodes that name
its folder) has a publisher too (`open_tier_publishers`), fed from the tier's writer thread. It clears and
republishes the tier's listing when it starts and whenever it resyncs; the registration names the entries
(`kv_tiers`) and the janitor keeps them while a live node names them. Stopping a node leaves them: the store
outlives it, and so do its other users.
Redis being down never stops the node: start-up logs it and the heartbeat and publisher keep retrying.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvrelay.common import wire
from kvrelay.common.records import NodeLoad
from kvrelay.index import IndexUnavailable, NodeRegistration, create_index, create_registry
from kvrelay.index.base import BlockIndex, RegistryBackend
from kvrelay.index.heartbeat import Heartbeat
from kvrelay.index.publisher import IndexPublisher
from kvrelay.index.redis_server import redact
from kvrelay.node.config import RegistryConfig

logger = logging.getLogger(__name__)


@dataclass
class Registration:
    registry: RegistryBackend
    index: BlockIndex
    heartbeat: Heartbeat
    publisher: IndexPublisher
    node_id: str
    model_id: str
    tier_publishers: tuple[IndexPublisher, ...] = ()

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        self.heartbeat.stop()
        self.publisher.close(timeout_s=2.0)
        for tier in self.tier_publishers:
            tier.close(timeout_s=2.0)
            tier.index.close()
        try:
            self.registry.deregister(self.node_id, self.model_id)
            logger.info("deregistered %s", self.node_id)
        except IndexUnavailable as e:
            logger.warning("could not deregister %s (its lease will lapse): %s", self.node_id, e)
        self.index.close()
        self.registry.close()


def open_publisher(config: RegistryConfig, node_id: str, model_id: str) -> IndexPublisher | None:
    """The node's index publisher, not started (None without a Redis URL)."""
    if not config.redis_url:
        return None
    return IndexPublisher(create_index(config.redis_url, model_id), node_id, clear_on_start=False, start=False)


def open_tier_publishers(config: RegistryConfig, model_id: str, tier_ids: Mapping[str, str]
                         ) -> dict[str, IndexPublisher]:
    """A publisher, not started, for each offload tier's index entry, by tier name ({} without a Redis URL)."""
    if not config.redis_url:
        return {}
    return {name: IndexPublisher(create_index(config.redis_url, model_id), entry_id, start=False)
            for name, entry_id in tier_ids.items()}


async def start_registration(
    config: RegistryConfig, info: wire.NodeInfo, load_fn: Callable[[], NodeLoad], publisher: IndexPublisher | None,
    tier_publishers: Mapping[str, IndexPublisher] | None = None,
) -> Registration | None:
    if not config.redis_url or publisher is None:
        logger.info("no --redis-url: running unregistered (reach this node by its address)")
        return None
    tiers = tuple((tier_publishers or {}).values())
    return await asyncio.to_thread(_start, config, info, load_fn, publisher, tiers)


def _start(config: RegistryConfig, info: wire.NodeInfo, load_fn: Callable[[], NodeLoad],
           publisher: IndexPublisher, tiers: tuple[IndexPublisher, ...]) -> Registration:
    reg = NodeRegistration(
        node_id=info.node_id, role=info.role, grpc_address=info.grpc_address, kv_address=info.kv_address,
        connector=info.connector, model_id=info.model_id, block_size=info.block_size, dtype=info.dtype,
        capacity_tokens=info.capacity_tokens, metrics_address=info.metrics_address, started_at=time.time(),
        kv_tiers=tuple(t.node_id for t in tiers),
    )
    index, registry = publisher.index, create_registry(config.redis_url)
    try:
        index.clear_node(reg.node_id)
        registry.register(reg, config.ttl_s, load_fn())
        logger.info("registered %s in %s (lease %.1fs)", reg.node_id, redact(config.redis_url), config.ttl_s)
    except IndexUnavailable as e:
        publisher.request_resync()  # clears and republishes once Redis answers
        logger.warning("registry unreachable at start, will keep trying: %s", e)
    publisher.start()
    for tier in tiers:  # after the registration that keeps the janitor off their entries
        tier.start()

    def resync() -> None:  # the janitor may have purged our entries, and the tiers' when no one else names them
        for p in (publisher, *tiers):
            p.request_resync()

    heartbeat = Heartbeat(registry, reg, config.ttl_s, load_fn, on_lapse=resync, interval_s=config.heartbeat_s).start()
    return Registration(registry, index, heartbeat, publisher, reg.node_id, reg.model_id, tiers)
