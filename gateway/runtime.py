"""The gateway's parts wired together, with start and stop; the HTTP and gRPC servers sit on top (the HTTP
server drains on SIGTERM: gateway/server.py).

Shared by every model: discovery, node clients, liveness, metrics, the registry, admission and shutdown
(core.Activity), the LoRA adapters' table. Per base model (gateway.models.ModelEndpoint): its tokenizer, block
index, router, dispatcher, core and endpoints. `core`, `router`, `tokenizer`, ... are the first (default) model's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid
from pathlib import Path

from kvrelay.common.tls import tls_from_flags
from kvrelay.common.tokenizer import Tokenizer
from kvrelay.gateway.adapters import Adapters
from kvrelay.gateway.admission import Activity, Admission
from kvrelay.gateway.auth import KeyStore
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.core import GatewayCore
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
from kvrelay.gateway.dispatch import DispatchConfig, Dispatcher
from kvrelay.gateway.fleet_metrics import FleetMetrics
from kvrelay.gateway.idempotency import IdempotentRequests
from kvrelay.gateway.images import ChatImages
from kvrelay.gateway.input_limits import InputLimits
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.models import ModelEndpoint, ModelView, ServedModels, assign_names
from kvrelay.gateway.node_client import NodeClients, Timeouts
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.ratelimit import RateLimiter
from kvrelay.gateway.router import Router, wait_for_nodes
from kvrelay.gateway.serving_chat import ChatServing
from kvrelay.gateway.serving_completions import CompletionServing
from kvrelay.gateway.serving_embeddings import EmbeddingServing
from kvrelay.gateway.serving_tokenize import TokenizeServing
from kvrelay.gateway.shared_answers import SharedAnswers
from kvrelay.gateway.tool_parsers import create_tool_parser
from kvrelay.model_files.pooling import pooling_config
from kvrelay.model_files.resolve import resolve_model
from kvrelay.model_files.vision import text_config, vision_spec

logger = logging.getLogger(__name__)


_MIRROR_READY_S = 5.0  # at start, how long the mirror may take to load before requests route without hints


def open_index(redis_url: str, model_id: str, backend: str = "mirror"):
    """One model's block index (kvrelay.index; 'memory' for in-process tests). `backend` "mirror" follows the
    index into this process (lookups without a round trip)."""
    from kvrelay.index import create_index

    return create_index(redis_url, model_id, backend=backend)


def open_registry(redis_url: str):
    from kvrelay.index import create_registry

    return create_registry(redis_url)


class Gateway:
    """`tokenizer`: the first model's (tests; None: read from the model's folder)."""

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        specs = [config.model, *config.other_models]
        resolved = [resolve_model(spec) for spec in specs]
        model_ids = [r.model_id for r in resolved]
        if len(set(model_ids)) != len(model_ids):
            raise ValueError(f"model: the same model given twice ({', '.join(model_ids)})")
        names = assign_names(model_ids, specs, config.served_model_names)
        self.metrics = GatewayMetrics(names[0][0], config.routing_policy)
        self.keys = KeyStore(config.api_key, config.api_keys_file)
        self.limiter = RateLimiter(config.redis_url, f"gw-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.input_limits = InputLimits.from_config(config)
        self.clients = NodeClients(Timeouts(prefill_s=config.prefill_timeout),
                                   tls_from_flags(config.tls_ca_file, config.tls_cert_file, config.tls_key_file))
        self.registry = open_registry(config.redis_url) if config.redis_url else None
        self.discovery = Discovery(DiscoveryConfig(
            model_id=model_ids[0], block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
            other_models=tuple(model_ids[1:]),
            static_prefill=tuple(config.prefill), static_decode=tuple(config.decode),
            refresh_s=config.refresh_interval, health_s=config.health_interval, probe_timeout_s=config.probe_timeout,
        ), self.clients, self.registry, self.metrics)
        self.liveness = Liveness(self.discovery, config.stall_timeout)
        self.adapters = Adapters(self.discovery.nodes, self.clients)
        self.activity = Activity()
        parser = create_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        endpoints = [self._endpoint(r, n, parser, tokenizer if i == 0 else None)
                     for i, (r, n) in enumerate(zip(resolved, names))]
        self.models = ServedModels(endpoints, self.adapters)
        first = endpoints[0]
        self.model_id, self.tokenizer, self.index = first.model_id, first.tokenizer, first.index
        self.router, self.dispatcher, self.core = first.router, first.dispatcher, first.core
        self.chat, self.completions, self.tokenize = first.chat, first.completions, first.tokenize
        self.metrics.watch(self.discovery, self.index)
        self.metrics.watch_admission(self.activity, config.max_concurrent_requests)
        self.fleet_metrics = (FleetMetrics(self.metrics.registry, self.discovery.nodes, config.node_metrics_timeout)
                              if config.fleet_metrics else None)
        self.shared_answers = (SharedAnswers(config.redis_url) if config.redis_url and config.idempotency_ttl > 0
                               else None)
        self.idempotency = IdempotentRequests(config.idempotency_ttl, on_replay=self.metrics.observe_replay,
                                              resume_grace_s=config.stream_resume_grace, shared=self.shared_answers)
        self.started_at = time.time()
        self.grpc_port: int | None = None  # the gRPC API's, once it listens (kvrelay.gateway.grpc_api)
        self.grpc_server = None  # its grpc.aio.Server
        self.handing_over = False  # a rolling restart's successor has the ports (kvrelay.gateway.server)

    def _endpoint(self, resolved, names: tuple[str, ...], parser, tokenizer: Tokenizer | None) -> ModelEndpoint:
        config, model_id = self.config, resolved.model_id
        index = open_index(config.redis_url, model_id, config.index_backend) if config.redis_url else None
        router = Router(ModelView(self.discovery, model_id), make_policy(config.routing_policy), index,
                        config.local_prefill_threshold, self.metrics, config.lookup_timeout,
                        lora_costs=self.adapters.extra_cost)
        dispatcher = Dispatcher(router, self.clients, self.discovery, self.liveness, self.metrics,
                                DispatchConfig(lease_ms=config.kv_lease_ms, migration_limit=config.migration_limit,
                                               queue_timeout_s=config.queue_timeout,
                                               capacity_wait_s=config.capacity_wait), self.adapters)
        tokenizer = tokenizer or Tokenizer(resolved.path)
        core = GatewayCore(tokenizer, router, dispatcher, self.metrics, config.max_model_len,
                           _model_context(resolved.path),
                           Admission(config.max_concurrent_requests, config.request_timeout, config.shed_at,
                                     config.tenant_cache_isolation), self.activity,
                           usage_sink=self.limiter.charge_tokens)
        images = ChatImages(vision_spec(resolved.path), self.input_limits, model_id, self.metrics)
        chat = ChatServing(core, parser, images)
        return ModelEndpoint(model_id, str(resolved.path), names, tokenizer, index, router, dispatcher, core, chat,
                             CompletionServing(core), TokenizeServing(core, chat.render_for_tokenize),
                             EmbeddingServing(core, pooling_config(resolved.path)), images)

    @property
    def served_names(self) -> list[str]:
        """Every base model's served names (adapters are in `adapters`)."""
        return self.models.names()

    def health_reasons(self) -> list[str]:
        """Why the gateway serves in a degraded way, if it does."""
        reasons = []
        if self.discovery.registry_error:
            reasons.append("node registry unreachable, routing to the last known nodes: "
                           + self.discovery.registry_error)
        errors = {ep.router.index_error for ep in self.models.endpoints if ep.router.index_error}
        for error in sorted(errors):
            reasons.append(f"block index unreachable, routing without prefix information: {error}")
        if self.limiter.degraded_reason:
            reasons.append(self.limiter.degraded_reason)
        down = [n.node_id for n in self.discovery.nodes() if not n.healthy and n.refused is None]
        if down:
            reasons.append(f"nodes out of rotation: {', '.join(down)}")
        return reasons

    async def start(self) -> None:
        for index in (ep.index for ep in self.models.endpoints if ep.index is not None):
            if not await asyncio.to_thread(index.wait_ready, _MIRROR_READY_S):
                logger.warning("index mirror not loaded after %.0f s; routing without prefix hints until it is",
                               _MIRROR_READY_S)
        await self.limiter.start()
        if self.shared_answers is not None:
            await self.shared_answers.start()
        self._watch_sighup()
        await self.discovery.start()
        self.liveness.start()
        if self.config.startup_timeout > 0 and not await wait_for_nodes(self.discovery, self.config.startup_timeout):
            logger.warning("no decode node after %.0f s; serving anyway (requests get 503 until one is up)",
                           self.config.startup_timeout)
        nodes = self.discovery.nodes()
        logger.info("gateway for %s: %d prefill and %d decode nodes routable, policy %s",
                    ", ".join(ep.model_id for ep in self.models.endpoints),
                    sum(n.routable and n.role == "prefill" for n in nodes),
                    sum(n.routable and n.role == "decode" for n in nodes), self.config.routing_policy)

    def _watch_sighup(self) -> None:
        """SIGHUP re-reads --api-keys-file (only where the loop runs in the main thread: `kvrelay gateway`)."""
        if self.keys.keys_file is None:
            return
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.keys.reload)
        except (RuntimeError, ValueError):
            logger.info("not in the main thread: --api-keys-file is not reloaded on SIGHUP")

    async def stop(self) -> None:
        await self.limiter.stop()
        if self.shared_answers is not None:
            await self.shared_answers.stop()
        await self.liveness.stop()
        await self.discovery.stop()
        for ep in self.models.endpoints:
            ep.router.close()
            await ep.dispatcher.drain(2.0)
        await self.clients.close()
        if self.fleet_metrics is not None:
            await self.fleet_metrics.close()
        for obj in [*(ep.index for ep in self.models.endpoints), self.registry]:
            close = getattr(obj, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


def _model_context(path) -> int:
    try:
        config = text_config(json.loads((Path(path) / "config.json").read_text()))
        return int(config.get("max_position_embeddings", 2048))
    except (OSError, ValueError):
        return 2048
