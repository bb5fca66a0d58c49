"""The gateway's parts wired together, with start and stop; the HTTP and gRPC servers sit on top (the HTTP
server drains on SIGTERM: gateway/server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from kvrelay.common.tokenizer import Tokenizer
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.core import Admission, GatewayCore
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
from kvrelay.gateway.dispatch import DispatchConfig, Dispatcher
from kvrelay.gateway.fleet_metrics import FleetMetrics
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.node_client import NodeClients, Timeouts
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import Router, wait_for_nodes
from kvrelay.gateway.serving_chat import ChatServing
from kvrelay.gateway.serving_completions import CompletionServing
from kvrelay.gateway.serving_tokenize import TokenizeServing
from kvrelay.gateway.tool_parsers import create_tool_parser
from kvrelay.model_files.resolve import resolve_model

logger = logging.getLogger(__name__)


_MIRROR_READY_S = 5.0  # at start, how long the mirror may take to load before requests route without hints


def open_index(redis_url: str, model_id: str, backend: str = "mirror"):
    """The block index and the node registry on one Redis (kvrelay.index; 'memory' for in-process tests).
    `backend` "mirror" follows the index into this process (lookups without a round trip)."""
    from kvrelay.index import create_index, create_registry

    return create_index(redis_url, model_id, backend=backend), create_registry(redis_url)


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        resolved = resolve_model(config.model)
        self.model_id = resolved.model_id
        self.tokenizer = tokenizer or Tokenizer(resolved.path)
        self.served_names = list(config.served_model_names) or [self.model_id]
        self.metrics = GatewayMetrics(self.served_names[0], config.routing_policy)
        self.clients = NodeClients(Timeouts(prefill_s=config.prefill_timeout))
        self.index, self.registry = (open_index(config.redis_url, self.model_id, config.index_backend)
                                     if config.redis_url else (None, None))
        self.discovery = Discovery(DiscoveryConfig(
            model_id=self.model_id, block_size=config.block_size, static_prefill=tuple(config.prefill),
            static_decode=tuple(config.decode), refresh_s=config.refresh_interval, health_s=config.health_interval,
            probe_timeout_s=config.probe_timeout,
        ), self.clients, self.registry, self.metrics)
        self.liveness = Liveness(self.discovery, config.stall_timeout)
        policy = make_policy(config.routing_policy)
        self.router = Router(self.discovery, policy, self.index, config.local_prefill_threshold, self.metrics,
                             config.lookup_timeout)
        self.dispatcher = Dispatcher(self.router, self.clients, self.discovery, self.liveness, self.metrics,
                                     DispatchConfig(lease_ms=config.kv_lease_ms, migration_limit=config.migration_limit,
                                                    queue_timeout_s=config.queue_timeout,
                                                    capacity_wait_s=config.capacity_wait))
        self.core = GatewayCore(self.tokenizer, self.router, self.dispatcher, self.metrics, config.max_model_len,
                                _model_context(resolved.path),
                                Admission(config.max_concurrent_requests, config.request_timeout))
        parser = create_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        self.chat = ChatServing(self.core, self.served_names, parser)
        self.completions = CompletionServing(self.core, self.served_names)
        self.tokenize = TokenizeServing(self.core, self.served_names, self.chat.render_for_tokenize)
        self.fleet_metrics = (FleetMetrics(self.metrics.registry, self.discovery.nodes, config.node_metrics_timeout)
                              if config.fleet_metrics else None)
        self.started_at = time.time()

    def health_reasons(self) -> list[str]:
        """Why the gateway serves in a degraded way, if it does."""
        reasons = []
        if self.discovery.registry_error:
            reasons.append("node registry unreachable, routing to the last known nodes: "
                           + self.discovery.registry_error)
        if self.router.index_error:
            reasons.append(f"block index unreachable, routing without prefix information: {self.router.index_error}")
        down = [n.node_id for n in self.discovery.nodes() if not n.healthy and n.refused is None]
        if down:
            reasons.append(f"nodes out of rotation: {', '.join(down)}")
        return reasons

    async def start(self) -> None:
        if self.index is not None and not await asyncio.to_thread(self.index.wait_ready, _MIRROR_READY_S):
            logger.warning("index mirror not loaded after %.0f s; routing without prefix hints until it is",
                           _MIRROR_READY_S)
        await self.discovery.start()
        self.liveness.start()
        if self.config.startup_timeout > 0 and not await wait_for_nodes(self.discovery, self.config.startup_timeout):
            logger.warning("no decode node after %.0f s; serving anyway (requests get 503 until one is up)",
                           self.config.startup_timeout)
        nodes = self.discovery.nodes()
        logger.info("gateway for %s: %d prefill and %d decode nodes routable, policy %s", self.model_id,
                    sum(n.routable and n.role == "prefill" for n in nodes),
                    sum(n.routable and n.role == "decode" for n in nodes), self.config.routing_policy)

    async def stop(self) -> None:
        await self.liveness.stop()
        await self.discovery.stop()
        self.router.close()
        await self.dispatcher.drain(2.0)
        await self.clients.close()
        if self.fleet_metrics is not None:
            await self.fleet_metrics.close()
        for obj in (self.index, self.registry):
            close = getattr(obj, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


def _model_context(path) -> int:
    try:
        return int(json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings", 2048))
    except (OSError, ValueError):
        return 2048
