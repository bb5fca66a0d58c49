"""Run one node process: engine, KV connector, gRPC server, metrics endpoint, registry.

The runtime is role-agnostic: the caller (the CLI) passes the role's server class, a NodeServer subclass.

Node lifecycle:
1. Limit torch's threads (several nodes on one machine must not each spin every core). Bind the gRPC and
   metrics ports first, so that a taken port fails in a second, not after the model loaded; the metrics
   endpoint answers /health with 503 {"status": "loading"} meanwhile (what `kvrelay up` reports, and what a
   startup probe waits on).
2. Create the connector and build the engine with it (the engine registers its KV caches with the connector).
3. Open the index publisher; build the role's server around the engine, the connector and the publisher.
4. Start the engine thread, the gRPC server and the metrics endpoint's real handler; register in the index
   (with a Redis URL): clear old entries, heartbeat with load, publish block events.
5. Write the ready file so launchers know the addresses.
6. On SIGTERM / SIGINT: stop taking work (new RPCs get UNAVAILABLE, Health says draining), deregister,
   let in-flight requests finish within the shutdown timeout, close everything, return 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch

from kvrelay.common import tracing
from kvrelay.common.system import advertised, format_cores, is_loopback, usable_cores
from kvrelay.engine.config import dtype_name
from kvrelay.engine.core import EngineCore
from kvrelay.kv_transfer import KVConnector, create_connector
from kvrelay.node.config import NodeConfig
from kvrelay.node.metrics import MetricsServer, NodeMetrics
from kvrelay.node.registration import Registration, open_publisher, open_tier_publishers, start_registration
from kvrelay.node.server import NodeServer, NodeSettings
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001
_IDLE_STREAMS_GRACE_S = 0.5
_FLUSH_S = 2.0

_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def default_num_threads(local_nodes: int) -> int:
    return max(1, len(usable_cores()) // max(1, local_nodes))


def build_connector(config: NodeConfig) -> KVConnector:
    # Without Python futures, ucxx awaits every pending request by spinning its event loop (sleep(0)); the
    # idle receive each connection keeps posted then holds the GIL most of the time and slows the engine
    # thread and the gRPC loop many times over. With them a notifier thread completes the futures.
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    conn = config.connector
    return create_connector(conn.name, replace(conn, host=advertised(conn.host)))


@dataclass
class Node:
    """Everything one node process runs, for an orderly start and stop."""

    servicer: NodeServer
    grpc_server: grpc.aio.Server
    metrics_server: MetricsServer
    connector: KVConnector
    registration: Registration | None

    async def drain(self, timeout: float) -> None:
        engine, node_id = self.servicer.engine, self.servicer.settings.node_id
        logger.info("draining %s: no new requests; waiting up to %.0fs for in-flight ones", node_id, timeout)
        engine.stop_accepting()
        if self.registration is not None:
            await self.registration.stop()
        await engine.shutdown(timeout)
        # The aborts (what tells a gateway "node stopped") go out before the listener closes: a gateway whose
        # probe is refused while they are still on their way would report a dead node instead.
        if not await self.servicer.streams_flushed(_FLUSH_S):
            logger.warning("%s: token streams still open %.0fs after the engine stopped", node_id, _FLUSH_S)
        # In-flight requests are over; what is left are idle streams (a gateway's GenerateMany): no reason to wait.
        await self.grpc_server.stop(grace=_IDLE_STREAMS_GRACE_S)
        self.servicer.close()
        self.metrics_server.close()
        await asyncio.to_thread(self.connector.close)
        logger.info("%s stopped", node_id)


def _build_core(config: NodeConfig, connector: KVConnector) -> EngineCore:
    """The engine, loaded and warmed up on a thread that ends with the build.

    libgomp keeps an OpenMP team for every thread that ever started a parallel region. Loaded on the main
    thread, which then runs the event loop for good, the model would leave an idle team behind; libgomp, then
    managing more threads than cores, stops spinning between the engine thread's regions and wakes its
    worker through the kernel for each one (some 150 per step). The finished thread takes its team with it,
    leaving the engine thread's as the only one: +5% served fp32 tokens/s on 2 cores
    (docs/results/2026-11-25-zen5/NOTES.md).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-engine-build") as pool:
        return pool.submit(EngineCore, config.engine, record_block_events=bool(config.registry.redis_url),
                           kv_sender=connector, kv_allocator=connector.kv_allocator()).result()


async def start_node(config: NodeConfig, server_cls: type[NodeServer]) -> Node:
    # The engine thread and the event loop (gRPC streams) share the GIL. When a kernel returns while the loop
    # runs Python, the engine waits for the GIL, and the engine's other core with it, up to the switch
    # interval: 1 ms instead of Python's 5 measured +6% served tokens/s (docs/results/2026-11-25-zen5/NOTES.md).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if config.cpu_cores:
        try:
            os.sched_setaffinity(0, config.cpu_cores)  # before torch's OpenMP team starts: it inherits them
        except OSError as e:
            raise ValueError(f"cpu_cores: cannot run on cores {format_cores(config.cpu_cores)} ({e}); this "
                             f"process may use {format_cores(usable_cores())}") from None
    torch.set_num_threads(config.num_threads or (len(config.cpu_cores) if config.cpu_cores
                                                 else default_num_threads(config.local_nodes)))
    grpc_server = grpc.aio.server(options=_GRPC_OPTIONS)
    try:
        address = f"{config.host}:{config.port}"
        if config.tls is None and not is_loopback(config.host):
            logger.warning("gRPC on %s without --tls-ca-file/--tls-cert-file/--tls-key-file: anyone who reaches "
                           "this port can drive the engine; give the fleet's certificates (docs/security.md)",
                           config.host)
        port = (grpc_server.add_secure_port(address, config.tls.server_credentials()) if config.tls is not None
                else grpc_server.add_insecure_port(address))
    except RuntimeError as e:
        raise ValueError(f"port: cannot listen on {config.host}:{config.port} ({e})") from None
    try:
        metrics_server = MetricsServer(config.host, config.metrics_port)
    except OSError as e:
        raise ValueError(f"metrics_port: cannot listen on {config.host}:{config.metrics_port} ({e})") from None
    metrics_server.start_loading()
    connector = build_connector(config)
    try:
        core = _build_core(config, connector)
    except BaseException:
        connector.close()
        metrics_server.close()
        raise
    host = advertised(config.host)
    served = config.served_model_name or core.info.model_id
    settings = NodeSettings(
        node_id=config.node_id or f"{server_cls.role}-{host}-{port}", served_model_name=served,
        connector_name=config.connector.name, grpc_address=f"{host}:{port}",
        metrics_address=f"{host}:{metrics_server.port}", transfer_timeout=config.connector.transfer_timeout,
        kv_lease_s=config.engine.scheduler.kv_lease_s,
    )
    metrics = NodeMetrics(served, config.connector.name)
    metrics.observe_config(config.engine, str(core.info.device), dtype_name(core.info.dtype), core.max_model_len,
                           core.num_blocks)
    tracing.setup_tracing(f"kvrelay-{server_cls.role}", config.otlp_traces_endpoint,
                          {"kvrelay.node_id": settings.node_id})
    publisher = open_publisher(config.registry, settings.node_id, core.info.model_id)
    tier_publishers = open_tier_publishers(config.registry, core.info.model_id, core.offload_tier_ids())
    servicer = server_cls(core, connector, metrics, settings, block_events=publisher, tier_events=tier_publishers)
    pb_grpc.add_EngineServicer_to_server(servicer, grpc_server)
    servicer.start()
    await grpc_server.start()
    metrics_server.start(metrics, servicer.health)
    registration = await start_registration(config.registry, servicer.node_info(), servicer.engine.load, publisher,
                                            tier_publishers)
    logger.info("%s node %s serving gRPC on %s, KV on %s (%s), metrics on http://%s/metrics, %d torch threads on "
                "cores %s", server_cls.role, settings.node_id, settings.grpc_address, connector.address,
                config.connector.name, settings.metrics_address, torch.get_num_threads(), format_cores(usable_cores()))
    return Node(servicer, grpc_server, metrics_server, connector, registration)


def write_ready_file(path: str, node: Node) -> None:
    info = node.servicer.node_info()
    data = {"node_id": info.node_id, "role": info.role, "grpc_address": info.grpc_address,
            "kv_address": info.kv_address, "metrics_address": info.metrics_address, "pid": os.getpid()}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: a watcher never reads half a file


async def serve(config: NodeConfig, server_cls: type[NodeServer]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = await start_node(config, server_cls)
    if config.ready_file:
        write_ready_file(config.ready_file, node)
    await stop.wait()
    await node.drain(config.shutdown_timeout_s)
    tracing.shutdown_tracing()
    # asyncio.run restores the default handlers on the way out: a late SIGTERM must not turn exit 0 into -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return 0
