"""Registry and index wiring of a node (shared/index): register with a TTL, heartbeat with load, publish the
block pool's events, deregister on shutdown. Without --redis-url the node runs unregistered."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


async def start_registration(args: argparse.Namespace, servicer) -> object | None:
    if not args.redis_url:
        logger.info("no --redis-url: running unregistered (reach this node by its address)")
        return None
    logger.warning("--redis-url given but the index client (shared/index) is not available yet: running unregistered")
    return None
