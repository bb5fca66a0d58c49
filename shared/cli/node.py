"""`kvrelay prefill` and `kvrelay decode`: run a node. Flags mirror vLLM's where they exist; their defaults are
NodeConfig's (kvrelay.node.config: the engine a node serves with, its connector, registry and ports). Each flag
can also come from the environment as KVRELAY_<FLAG> (e.g. KVRELAY_PORT=50061, KVRELAY_ENABLE_PREFIX_CACHING=0);
a flag on the command line wins over the environment.

    kvrelay prefill --model default --port 50061 --num-threads 1      # --connector auto: shm on one host
    kvrelay decode  --model default --port 50062 --num-threads 1
"""

from __future__ import annotations

import argparse
import os

from kvrelay.cli.args import HelpFormatter, add_field_flags, add_tls_flags, core_list
from kvrelay.cli.log import exit_now
from kvrelay.cli.preflight import check_engine, check_port
from kvrelay.common.tls import tls_from_flags
from kvrelay.engine.args import add_engine_args, engine_config
from kvrelay.kv_transfer import CONNECTORS, ConnectorConfig
from kvrelay.node.config import NodeConfig, RegistryConfig

ROLES = {
    "prefill": ("computes prompts and hands their KV to decode nodes", 50061),
    "decode": ("reserves KV blocks, admits transferred requests and streams tokens", 50062),
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def register(subparsers) -> None:
    """Add `prefill` and `decode` to the `kvrelay` subcommands."""
    for role, (what, _) in ROLES.items():
        p = subparsers.add_parser(role, help=f"run a {role} node: {what}", description=__doc__,
                                  formatter_class=HelpFormatter)
        add_node_args(p, role)
        p.set_defaults(func=lambda args, role=role: run_node(args, role))


def add_node_args(p: argparse.ArgumentParser, role: str) -> None:
    d = NodeConfig()
    add_engine_args(p, d.engine)
    g = p.add_argument_group("node")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="model name in metrics labels (default: the model id)")
    g.add_argument("--port", type=int, default=ROLES[role][1], help="gRPC port; 0 picks a free one")
    g.add_argument("--node-id", default=d.node_id, help="name in the registry (default: <role>-<host>-<port>)")
    add_field_flags(g, d, {
        "host": "interface of the gRPC server and metrics endpoint",
        "metrics_port": "HTTP port of /metrics and /health; 0 picks a free one (logged, and in GetNodeInfo)",
        "local_nodes": "nodes sharing this machine's cores",
    })
    g.add_argument("--num-threads", type=int, default=d.num_threads,
                   help="torch CPU threads (default: the cores divided by --local-nodes; oversubscribed OpenMP "
                        "threads slow every node down many times)")
    g.add_argument("--cpu-cores", type=core_list, default=d.cpu_cores or None, metavar="LIST",
                   help="run on these cores only, one torch thread each unless --num-threads says otherwise "
                        "(taskset's form: 0-3,8; default: the cores it was started with)")
    g.add_argument("--seed", type=int, default=d.engine.model.seed, help="sampler seed for requests that bring none")
    g.add_argument("--shutdown-grace", "--shutdown-timeout", dest="shutdown_timeout", type=float,
                   default=d.shutdown_timeout_s, help="seconds in-flight requests get to finish after SIGTERM")
    add_tls_flags(g)
    g.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="send OpenTelemetry spans (node.reserve, node.prefill, kv_transfer, node.generate, kv_receive) "
                        "to this OTLP collector; the gateway's spans are their parents")
    g.add_argument("--ready-file", default=d.ready_file,
                   help="write a JSON file with the node's addresses once it serves (for launchers and tests)")
    k = p.add_argument_group("KV transfer")
    c = d.connector
    k.add_argument("--connector", choices=sorted(CONNECTORS), default=c.name,
                   help="auto (shared memory to nodes on this host, else --remote-connector), shm (same host "
                        "only, CPU), ucx (ucxx), nccl (torch.distributed; gloo on CPU), local (in-process only: "
                        "no KV to or from other processes, no transfer threads; `kvrelay up` gives it to a "
                        "colocated engine)")
    k.add_argument("--remote-connector", choices=["ucx", "nccl"], default=c.remote,
                   help="auto: the connector to nodes on other hosts")
    k.add_argument("--shm-dir", default=c.shm_dir,
                   help="shm/auto: folder of the control sockets (default /dev/shm); nodes use shared memory "
                        "only when they see the same folder on the same boot")
    k.add_argument("--kv-host", default=None, help="interface the connector listens on (default: --host)")
    k.add_argument("--kv-port", type=int, default=c.port, help="connector port; 0 picks a free one")
    k.add_argument("--ucx-transport", choices=["tcp", "shm", "auto"], default=c.transport,
                   help="ucx: tcp, shm (shared memory, same machine) or auto (UCX picks, CUDA included)")
    k.add_argument("--kv-lease-seconds", type=float, default=d.engine.scheduler.kv_lease_s,
                   help="reserved or held KV blocks nobody claims within this time are freed; must outlast the "
                        "longest prefill (tens of seconds for a 2k-token prompt on one CPU thread)")
    add_field_flags(k, c, {"transfer_timeout": "seconds one KV transfer may take"})
    k.add_argument("--kv-connect-timeout", type=float, default=c.connect_timeout,
                   help="seconds to reach a peer connector")
    r = p.add_argument_group("registry")
    r.add_argument("--redis-url", default=os.environ.get("KVRELAY_REDIS_URL", d.registry.redis_url),
                   help="Redis of the block index and node registry (redis://[user:password@]host:6379/0, rediss:// "
                        "for TLS, unix://[user:password@]/path; default: $KVRELAY_REDIS_URL); without it the node "
                        "runs unregistered")
    r.add_argument("--heartbeat-seconds", type=float, default=d.registry.heartbeat_s,
                   help="registry heartbeat (load) interval")
    r.add_argument("--registry-ttl", type=float, default=d.registry.ttl_s,
                   help="seconds a registration outlives its last heartbeat")
    apply_env_defaults(p)


def apply_env_defaults(p: argparse.ArgumentParser) -> None:
    """KVRELAY_<DEST> in the environment becomes the flag's default, and every help line names it. A bad
    value is reported when the node starts (args.env_errors), not while `kvrelay` builds its parser."""
    errors: list[str] = []
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        env = "KVRELAY_" + action.dest.upper()
        action.help = f"{action.help or ''} [env {env}]".strip()
        raw = os.environ.get(env)
        if raw is None:
            continue
        try:
            value = _env_value(action, raw)
        except ValueError as e:
            errors.append(f"{env}={raw!r}: {e}")
            continue
        if action.choices is not None and value not in action.choices:
            errors.append(f"{env}={raw!r}: choose one of {', '.join(map(str, action.choices))}")
            continue
        action.default = value
    p.set_defaults(env_errors=errors)


def _env_value(action: argparse.Action, raw: str):
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        return low in _TRUE
    return action.type(raw) if action.type is not None else raw


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node's config record from its flags (a bad environment variable is reported here)."""
    if getattr(args, "env_errors", None):
        raise ValueError("bad environment: " + "; ".join(args.env_errors))
    d = NodeConfig()
    connector = ConnectorConfig(
        name=args.connector, host=args.kv_host or args.host, port=args.kv_port, transport=args.ucx_transport,
        remote=args.remote_connector, shm_dir=args.shm_dir,
        connect_timeout=args.kv_connect_timeout, transfer_timeout=args.transfer_timeout,
    )
    return NodeConfig(
        engine=engine_config(args, d.engine, kv_lease_s=args.kv_lease_seconds, seed=args.seed), connector=connector,
        registry=RegistryConfig(args.redis_url, args.heartbeat_seconds, args.registry_ttl),
        host=args.host, port=args.port, metrics_port=args.metrics_port, node_id=args.node_id,
        served_model_name=args.served_model_name, num_threads=args.num_threads, cpu_cores=args.cpu_cores or (),
        local_nodes=args.local_nodes,
        shutdown_timeout_s=args.shutdown_timeout, ready_file=args.ready_file,
        tls=tls_from_flags(args.tls_ca_file, args.tls_cert_file, args.tls_key_file),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def server_class(role: str):
    """The role's server: the CLI is where the roles are chosen (the node runtime knows none of them)."""
    if role == "prefill":
        from kvrelay.prefill_node.server import PrefillServer

        return PrefillServer
    if role == "decode":
        from kvrelay.decode_node.server import DecodeServer

        return DecodeServer
    raise ValueError(f"role: {role!r} is not a node role ({', '.join(ROLES)})")


def check_node(config: NodeConfig) -> None:
    """What can be refused before the model loads (kvrelay.cli.preflight): the engine's settings against the
    model's config, and the node's ports."""
    check_engine(config.engine)
    check_port(config.host, config.port, "--port", "; --port 0 picks a free one")
    check_port(config.host, config.metrics_port, "--metrics-port", "; --metrics-port 0 picks a free one")


def run_node(args: argparse.Namespace, role: str) -> int:
    import asyncio

    from kvrelay.node.runtime import serve

    config = node_config(args)
    check_node(config)
    exit_now(asyncio.run(serve(config, server_class(role))))
