"""Run one node process: engine, KV connector, gRPC server, metrics endpoint, registry.

Node lifecycle:
1. Limit torch's threads (several nodes on one machine must not each spin every core), build the engine,
   create the connector and register the engine's KV caches with it.
2. Bind the gRPC server and the metrics endpoint, start the engine thread, serve.
3. Register in the index (with --redis-url): clear old entries, heartbeat with load, publish block events.
4. Write the ready file (--ready-file) so launchers know the addresses.
5. On SIGTERM / SIGINT: stop taking work (new RPCs get UNAVAILABLE, Health says draining), deregister,
   let in-flight requests finish within --shutdown-timeout, close everything, return 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from kv_transfer import ConnectorConfig, KVLayout, create_connector
from shared.async_engine import AsyncEngine
from shared.cli import engine_kwargs
from shared.engine import EngineCore
from shared.llm import engine_config_from_kwargs
from shared.node.metrics import MetricsServer, NodeMetrics
from shared.node.registration import start_registration
from shared.node.server import NodeServer, NodeSettings
from shared.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def default_num_threads(local_nodes: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_nodes))


def advertised(host: str) -> str:
    """The address others reach a wildcard bind on."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def server_class(role: str) -> type[NodeServer]:
    if role == "prefill":
        from prefill_node.server import PrefillServer

        return PrefillServer
    if role == "decode":
        from decode_node.server import DecodeServer

        return DecodeServer
    raise ValueError(f"role: {role!r} is not a node role (prefill, decode)")


def build_engine(args: argparse.Namespace) -> EngineCore:
    kwargs = engine_kwargs(args) | {"kv_lease_s": args.kv_lease_seconds, "seed": args.seed}
    config = engine_config_from_kwargs(args.model, args.dtype, **kwargs)
    return EngineCore(config, record_block_events=bool(args.redis_url))


def build_connector(args: argparse.Namespace, core: EngineCore):
    # Without Python futures, ucxx awaits every pending request by spinning its event loop (sleep(0)); the
    # idle receive each connection keeps posted then holds the GIL most of the time and slows the engine
    # thread and the gRPC loop many times over. With them a notifier thread completes the futures.
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    config = ConnectorConfig(
        name=args.connector, host=advertised(args.kv_host or args.host), port=args.kv_port,
        transport=args.ucx_transport, connect_timeout=args.kv_connect_timeout, transfer_timeout=args.transfer_timeout,
    )
    connector = create_connector(args.connector, config)
    caches = core.runner.kv_caches
    connector.register_kv_caches(KVLayout.for_caches(core.info.model_id, caches), caches)
    return connector


@dataclass
class Node:
    """Everything one node process runs, for an orderly start and stop."""

    role: str
    engine: AsyncEngine
    servicer: NodeServer
    grpc_server: grpc.aio.Server
    metrics_server: MetricsServer
    connector: object
    registration: object | None = None

    async def drain(self, timeout: float) -> None:
        logger.info("draining %s: no new requests; waiting up to %.0fs for in-flight ones",
                    self.servicer.settings.node_id, timeout)
        self.engine.stop_accepting()
        if self.registration is not None:
            await self.registration.stop()
        await self.engine.shutdown(timeout)
        await self.grpc_server.stop(grace=5.0)
        self.servicer.close()
        self.metrics_server.close()
        await asyncio.to_thread(self.connector.close)
        logger.info("%s stopped", self.servicer.settings.node_id)


async def start_node(args: argparse.Namespace, role: str) -> Node:
    torch.set_num_threads(args.num_threads or default_num_threads(args.local_nodes))
    cls = server_class(role)
    core = build_engine(args)
    connector = build_connector(args, core)
    served = args.served_model_name or core.info.model_id
    metrics = NodeMetrics(served, args.connector)
    engine = AsyncEngine(core, metrics)
    settings = NodeSettings(node_id="", role=role, served_model_name=served, connector_name=args.connector,
                            transfer_timeout=args.transfer_timeout, kv_lease_s=args.kv_lease_seconds)
    servicer = cls(engine, connector, metrics, settings)
    servicer.attach()
    grpc_server = grpc.aio.server(options=_GRPC_OPTIONS)
    pb_grpc.add_EngineServicer_to_server(servicer, grpc_server)
    try:
        port = grpc_server.add_insecure_port(f"{args.host}:{args.port}")
    except RuntimeError as e:
        connector.close()
        raise ValueError(f"port: cannot listen on {args.host}:{args.port} ({e})") from None
    host = advertised(args.host)
    settings.grpc_address = f"{host}:{port}"
    settings.node_id = args.node_id or f"{role}-{host}-{port}"
    metrics_server = MetricsServer(metrics, servicer.health, args.host, args.metrics_port)
    settings.metrics_address = f"{host}:{metrics_server.port}"
    engine.start()
    await grpc_server.start()
    metrics_server.start()
    node = Node(role, engine, servicer, grpc_server, metrics_server, connector)
    node.registration = await start_registration(args, servicer)
    logger.info("%s node %s serving gRPC on %s, KV on %s (%s), metrics on http://%s/metrics, %d torch threads",
                role, settings.node_id, settings.grpc_address, connector.address, args.connector,
                settings.metrics_address, torch.get_num_threads())
    return node


def write_ready_file(path: str, node: Node) -> None:
    info = node.servicer.node_info()
    data = {"node_id": info.node_id, "role": info.role, "grpc_address": info.grpc_address,
            "kv_address": info.kv_address, "metrics_address": info.metrics_address, "pid": os.getpid()}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: a watcher never reads half a file


async def serve(args: argparse.Namespace, role: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    node = await start_node(args, role)
    if args.ready_file:
        write_ready_file(args.ready_file, node)
    await stop.wait()
    await node.drain(args.shutdown_timeout)
    # asyncio.run restores the default handlers on the way out: a late SIGTERM must not turn exit 0 into -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return 0
