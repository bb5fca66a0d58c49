"""`kvrelay bench fleet`, and the one way benchmarks run servers under test: whole fleets (`kvrelay up`),
`vllm serve` and single nodes, each a ChildProcess in its own session with its log beside the results, stopped
(SIGTERM, then its process group killed) on leaving its block.

An arm (a server configuration) of `bench fleet`:
1. start its server on free ports and wait until it is ready (`kvrelay up`: its banner, printed once the gateway
   routes to every node; a server that exits fails the arm with its log's tail);
2. run `bench serve` against it in this process, saved as <output-dir>/fleet-<arm>.json with its plots;
3. stop it. Each arm starts cold (fresh processes, empty caches), so arms never share prefix-cache state.

Scenarios, each a pair of arms compared with `bench serve --compare` (B/A ratios, a combined CDF plot):
  disagg   A = colocated (one engine prefills and decodes), B = 1 prefill + 1 decode node; random dataset
  routing  A = round_robin, B = cache_aware, over N prefill + M decode nodes; multi-tenant dataset (shared
           system prompts), whose prefix-hit ratio and TTFT show what cache-aware routing buys
  vllm     A = `vllm serve` (vLLM's CPU build from its venv, as `bench throughput --baseline vllm` finds it),
           B = `kvrelay up` placed as it chooses, both in one dtype; concurrency 32 on 128 requests of 16-1,024
           input and 8-256 output tokens, run A B B A (--rounds 2) since a shared machine drifts: each round's
           pair is compared, and the mean ratio is printed last.
  llamacpp A = llama.cpp's own `llama-server` (32 slots, continuous batching, no prompt cache reuse, as the peer
           kit's llamacpp_serve.sh starts it) on the GGUF, B = `kvrelay up --quantization gguf` on the same file;
           the vllm scenario's load and rounds. Concurrency 1: --serve-args "--concurrency 1 --num-requests 16".
  kvcache  A = `kvrelay up` with the cache in the model's dtype, B = `--kv-cache-dtype int8` (or --kv-cache-dtype)
           in the same bytes of KV cache (16 MiB: a few sequences fit), on long answers (64-256 prompt and
           128-256 output tokens, concurrency 32): what a quantized cache buys where KV capacity bounds
           concurrency. Rounds as the vllm scenario.

    kvrelay bench fleet --scenario disagg
    kvrelay bench fleet --scenario routing --prefill-nodes 3 --serve-args "--num-requests 96 --tenants 12"
    kvrelay bench fleet --scenario vllm --dtype float32
    kvrelay bench fleet --scenario llamacpp
    kvrelay bench fleet --scenario kvcache --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from kvrelay.bench import parse_args, report, serve, vllm_baseline
from kvrelay.bench.llamacpp_baseline import gguf_and_tool
from kvrelay.common.hashing import KV_CACHE_DTYPES
from kvrelay.common.process import ChildProcess, kvrelay_command, pid_alive, stop_all
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from kvrelay.common.tls import TLSFiles
from kvrelay.common.units import byte_size

_STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")  # `kvrelay up` logs each start, restarts included


class Kind(enum.Enum):
    """What serves an arm."""

    KVRELAY = "kvrelay up"
    VLLM = "vllm serve"
    LLAMACPP = "llama-server"


class Server:
    """A server under test: its process and its OpenAI API root; a context manager that stops it."""

    def __init__(self, process: ChildProcess, base_url: str, scratch: str | None = None) -> None:
        self.process, self.base_url, self.scratch = process, base_url, scratch
        self.root = base_url.removesuffix("/v1")

    @classmethod
    def start(cls, name: str, argv: Sequence[str], base_url: str, ready: Callable[[Server], bool], *,
              log_dir: str | Path, timeout_s: float, env: dict[str, str] | None = None,
              scratch: str | None = None) -> Server:
        """`scratch`: a folder the server's processes use (vLLM's sockets), removed once they are stopped."""
        try:
            server = cls(ChildProcess.start(name, argv, env=env, log_dir=log_dir), base_url, scratch)
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        try:
            server.process.wait_ready(lambda: ready(server), timeout_s, interval_s=0.5)
        except BaseException:
            server.stop(grace_s=5.0)
            raise
        return server

    @classmethod
    def up(cls, flags: Sequence[str], *, log_dir: str | Path, timeout_s: float = 600.0,
           name: str = "kvrelay-up") -> Server:
        """`kvrelay up FLAGS` on free ports, ready once it prints its banner."""
        port = free_port()
        argv = kvrelay_command("up", "--port", str(port), "--grpc-port", str(free_port()), *flags)
        return cls.start(name, argv, f"http://127.0.0.1:{port}/v1",
                         lambda s: "kvrelay is up" in s.process.log_tail(400), log_dir=log_dir, timeout_s=timeout_s)

    def answers_health(self) -> bool:
        try:
            return httpx.get(self.root + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        """The gateway's /health ({} when it does not answer): node counts, and each node's id, role, address."""
        try:
            return httpx.get(self.root + "/health", timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return {}

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.root + "/metrics")

    def pids(self) -> dict[str, int]:
        """`kvrelay up`'s running children (nodes, gateway) by name, from its log (the latest start of each)."""
        latest = dict(_STARTED.findall(self.process.log_text()))
        return {name: int(pid) for name, pid in latest.items() if pid_alive(int(pid))}

    def node_channel(self, address: str, aio: bool = False):
        """A gRPC channel to one of the fleet's nodes: over mutual TLS with the certificates `kvrelay up` made in
        its run folder (its banner's "logs" line), plain for a fleet without them."""
        import grpc

        tls = self.fleet_tls()
        mod = grpc.aio if aio else grpc
        if tls is None:
            return mod.insecure_channel(address)
        return mod.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())

    def fleet_tls(self) -> TLSFiles | None:
        found = re.search(r"^  logs +: (.+)$", self.process.log_text(), re.MULTILINE)
        folder = Path(found.group(1).strip()) / "tls" if found else None
        if folder is None or not (folder / "ca.pem").is_file():
            return None
        # A gateway's client certificate: "gateway", or "gateway-0" of several (--gateways N).
        name = "gateway" if (folder / "gateway.pem").is_file() else "gateway-0"
        return TLSFiles(str(folder / "ca.pem"), str(folder / f"{name}.pem"), str(folder / f"{name}.key"))

    def stop(self, grace_s: float = 90.0) -> None:
        self.process.stop(grace_s)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads so far, to the nanosecond (Linux /proc/<pid>/task/*/schedstat; the
    user + system times of /proc/<pid>/stat count in 10 ms ticks, too coarse for a few requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    if total:
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Node:
    """One node process (`kvrelay prefill|decode --port 0`) and what its ready file says (addresses, id)."""

    process: ChildProcess
    info: dict
    _stub: object = field(default=None, repr=False)

    @classmethod
    def start_many(cls, specs: Sequence[tuple[str, Sequence[str]]], *, log_dir: str | Path, timeout_s: float = 600.0,
                   env: dict[str, str] | None = None) -> list[Node]:
        """Start every (role, flags) node at once; return them once each has written its ready file."""
        names = [f"{role}-{[r for r, _ in specs[:i]].count(role)}" for i, (role, _) in enumerate(specs)]
        ready = [Path(log_dir) / f"{name}.ready.json" for name in names]
        for path in ready:
            path.unlink(missing_ok=True)  # an earlier run's, in the same folder
        procs = [ChildProcess.start(name, kvrelay_command(role, "--port", "0", "--ready-file", str(path), *flags),
                                    env=env, log_dir=log_dir) for name, (role, flags), path in zip(names, specs, ready)]
        try:
            return [cls(p, json.loads(p.wait_ready(lambda f=f: f.is_file() and f.read_text(), timeout_s)))
                    for p, f in zip(procs, ready)]
        except BaseException:
            stop_all(procs)
            raise

    def stub(self):
        """The node's Engine service (one channel, kept)."""
        import grpc

        from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

        if self._stub is None:
            self._stub = pb_grpc.EngineStub(grpc.insecure_channel(self.info["grpc_address"]))
        return self._stub

    def metrics(self) -> Metrics:
        return Metrics.scrape(f"http://{self.info['metrics_address']}/metrics")


# -- `kvrelay bench fleet` ------------------------------------------------------------------------------

# Sized so that one arm takes a few minutes on a 2-core machine with the default model.
SERVE_DEFAULTS = {
    "disagg": "--dataset random --concurrency 4 --num-requests 48 --warmup 2 --min-input 64 --max-input 768 "
              "--min-output 16 --max-output 96 --ignore-eos",
    "routing": "--dataset multi-tenant --tenants 8 --system-len 768 --concurrency 4 --num-requests 64 --warmup 0 "
               "--min-input 16 --max-input 96 --max-tokens 16 --ignore-eos",
    "vllm": "--dataset random --concurrency 32 --num-requests 128 --warmup 2 --min-input 16 --max-input 1024 "
            "--min-output 8 --max-output 256 --ignore-eos",
}
SERVE_DEFAULTS["llamacpp"] = SERVE_DEFAULTS["vllm"]
SERVE_DEFAULTS["kvcache"] = ("--dataset random --concurrency 32 --num-requests 48 --warmup 2 --min-input 64 "
                             "--max-input 256 --min-output 128 --max-output 256 --ignore-eos")
LLAMACPP_SLOTS, LLAMACPP_CTX_PER_SLOT = 32, 2048  # the peer kit's llamacpp_serve.sh
# KV cache per node: several nodes share the machine in the fleet scenarios; against vLLM, one engine each,
# given as much as vLLM's CPU build gets.
KV_CACHE_DEFAULTS = {"disagg": 512 * 2**20, "routing": 512 * 2**20, "vllm": 2 * 2**30, "llamacpp": 2 * 2**30,
                     "kvcache": 16 * 2**20}
PAIRED = ("vllm", "llamacpp", "kvcache")  # the scenarios run in --rounds
HELP = "kvrelay up + bench serve: colocated vs disaggregated, routing policies, vs `vllm serve` or `llama-server`"


@dataclass(frozen=True)
class Arm:
    """A server configuration: its label, and `kvrelay up` flags (a kvrelay arm)."""

    label: str
    up_flags: tuple[str, ...] = ()
    kind: Kind = Kind.KVRELAY


def scenario_arms(scenario: str, prefill_nodes: int = 3, decode_nodes: int = 1,
                  kv_cache_dtype: str = "int8") -> tuple[Arm, Arm]:
    """(A, B): the baseline first, the configuration under test second."""
    if scenario == "kvcache":
        return Arm("kv-auto"), Arm(f"kv-{kv_cache_dtype}", ("--kv-cache-dtype", kv_cache_dtype))
    if scenario == "vllm":
        return Arm("vllm-serve", kind=Kind.VLLM), Arm("kvrelay-up")
    if scenario == "llamacpp":
        return Arm("llama-server", kind=Kind.LLAMACPP), Arm("kvrelay-up-gguf", ("--quantization", "gguf"))
    if scenario == "disagg":
        return Arm("colocated", ("--colocated",)), Arm("disagg-1p1d", ("--prefill", "1", "--decode", "1"))
    nodes = ("--prefill", str(prefill_nodes), "--decode", str(decode_nodes))
    return tuple(Arm(f"{policy}-{prefill_nodes}p{decode_nodes}d", (*nodes, "--routing-policy", policy))
                 for policy in ("round_robin", "cache_aware"))


def round_arms(a: Arm, b: Arm, rounds: int) -> list[tuple[Arm, Arm]]:
    """Each round's (A, B), labelled by round when there are several."""
    if rounds == 1:
        return [(a, b)]
    return [(replace(a, label=f"{a.label}-{r}"), replace(b, label=f"{b.label}-{r}")) for r in range(1, rounds + 1)]


def play_order(pairs: list[tuple[Arm, Arm]]) -> list[Arm]:
    """A B, B A, A B, ...: each arm runs first as often as last, so a drifting machine favours neither."""
    return [arm for r, (a, b) in enumerate(pairs) for arm in ((a, b) if r % 2 == 0 else (b, a))]


def serve_namespace(serve_args: list[str], base_url: str, label: str, output: Path) -> argparse.Namespace:
    args = parse_args(serve.__name__, [*serve_args, "--base-url", base_url, "--label", label, "--output", str(output)])
    serve.check_args(args)
    return args


def start_arm(arm: Arm, args: argparse.Namespace) -> tuple[Server, dict]:
    """The arm's server, started and ready, and what to record about it."""
    if arm.kind is Kind.VLLM:
        python = vllm_baseline.find_python(args.vllm_python)
        port, model = free_port(), args.resolved_model
        argv = vllm_baseline.serve_argv(python, str(model.path), model.model_id, args.dtype, port)
        scratch = tempfile.mkdtemp(prefix="kvrelay-vllm-")
        env = vllm_baseline.vllm_env(python, os.cpu_count() or 1, args.kv_cache_memory, scratch)
        server = Server.start(f"fleet-{arm.label}", argv, f"http://127.0.0.1:{port}/v1", Server.answers_health,
                              log_dir=args.output_dir, timeout_s=args.ready_timeout, env=env, scratch=scratch)
        return server, {"vllm_serve_argv": argv[1:]}
    if arm.kind is Kind.LLAMACPP:
        port, threads = free_port(), str(os.cpu_count() or 1)
        argv = [args.llama_server_path, "-m", args.gguf, "--alias", args.served_name, "--host", "127.0.0.1",
                "--port", str(port), "--threads", threads, "--threads-batch", threads, "--parallel",
                str(LLAMACPP_SLOTS), "--cont-batching", "--threads-http", str(LLAMACPP_SLOTS + 8), "--ctx-size",
                str(LLAMACPP_SLOTS * LLAMACPP_CTX_PER_SLOT), "--cache-reuse", "0", "--no-webui"]
        server = Server.start(f"fleet-{arm.label}", argv, f"http://127.0.0.1:{port}/v1", Server.answers_health,
                              log_dir=args.output_dir, timeout_s=args.ready_timeout)
        return server, {"llama_server_argv": argv}
    flags = ["--model", args.model, *arm.up_flags]
    if args.dtype != "auto":
        flags += ["--dtype", args.dtype]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    server = Server.up(flags, log_dir=args.output_dir, timeout_s=args.ready_timeout, name=f"fleet-{arm.label}")
    return server, {"kvrelay_up_flags": flags}


def run_arm(arm: Arm, args: argparse.Namespace, serve_args: list[str]) -> tuple[Path, dict]:
    """The arm's serve run on a server of its own: where its JSON went, and the result."""
    server, record = start_arm(arm, args)
    with server:
        return measure_arm(server, arm, record, args, serve_args)


def measure_arm(server: Server, arm: Arm, record: dict, args: argparse.Namespace,
                serve_args: list[str]) -> tuple[Path, dict]:
    output = Path(args.output_dir) / f"fleet-{arm.label}.json"
    result = serve.measure(serve_namespace(serve_args, server.base_url, arm.label, output))
    result["fleet"] = {**record, "machine": report.machine()}
    report.save(result, output, plot=not args.no_plot)
    print(json.dumps({k: result[k] for k in ("label", "completed", "failed", "request_throughput",
                                             "output_throughput", "prefix_hit_ratio")}
                     | {m: result[m]["p50"] for m in ("ttft_ms", "itl_ms", "e2e_ms")}, indent=1))
    if not result["completed"]:
        raise RuntimeError(f"{arm.label}: no request completed; errors: {result['errors']}")
    return output, result


def run_scenario(scenario: str, args: argparse.Namespace, serve_args: list[str]) -> dict:
    rounds = args.rounds if scenario in PAIRED else 1
    pairs = round_arms(*scenario_arms(scenario, args.prefill_nodes, args.decode_nodes, args.kv_cache_dtype), rounds)
    runs = {arm.label: run_arm(arm, args, serve_args) for arm in play_order(pairs)}
    summary = []
    for r, (a, b) in enumerate(pairs, start=1):
        (path_a, ra), (path_b, rb) = runs[a.label], runs[b.label]
        out = Path(args.output_dir) / f"fleet-{scenario}-compare{f'-{r}' if rounds > 1 else ''}.json"
        report.run_compare(str(path_a), str(path_b), str(out), not args.no_plot)
        summary.append({"a": a.label, "b": b.label,
                        **{k: [ra[k], rb[k]] for k in ("output_throughput", "prefix_hit_ratio")},
                        "ttft_p90_ms": [ra["ttft_ms"]["p90"], rb["ttft_ms"]["p90"]]})
    a_total, b_total = (sum(s["output_throughput"][i] for s in summary) for i in (0, 1))
    return {"scenario": scenario, "rounds": summary,
            "mean_output_throughput_b_over_a": b_total / a_total if a_total else None}


def run(args: argparse.Namespace) -> int:
    from kvrelay.model_files.resolve import resolve_model

    tokenizer = args.tokenizer
    if tokenizer is None and (args.model == "default" or os.path.isdir(args.model)):
        tokenizer = str(resolve_model(args.model).path)  # dataset lengths in the served model's tokens
    for scenario in ["disagg", "routing"] if args.scenario == "all" else [args.scenario]:
        serve_args = shlex.split(SERVE_DEFAULTS[scenario]) + shlex.split(args.serve_args or "")
        if tokenizer and "--tokenizer" not in serve_args:
            serve_args += ["--tokenizer", tokenizer]
        scenario_args = argparse.Namespace(**vars(args))
        scenario_args.kv_cache_memory = args.kv_cache_memory or KV_CACHE_DEFAULTS[scenario]
        if scenario == "vllm":
            scenario_args.dtype = resolved_dtype(args.dtype)  # the same explicit dtype for both servers
            scenario_args.resolved_model = resolve_model(args.model)  # vLLM is given its HF folder
        if scenario == "llamacpp":
            scenario_args.gguf, scenario_args.served_name, scenario_args.llama_server_path = llamacpp_inputs(args)
        print(json.dumps(run_scenario(scenario, scenario_args, serve_args), indent=1))
    return 0


def llamacpp_inputs(args: argparse.Namespace) -> tuple[str, str, str]:
    """(the GGUF, the name both servers serve it by, llama-server), or SystemExit saying what is missing."""
    from kvrelay.model_files.resolve import resolve_model

    gguf, server = gguf_and_tool(args.model, "llama-server", args.llama_server, "bench fleet --scenario llamacpp")
    return gguf, resolve_model(args.model).model_id, server


def resolved_dtype(dtype: str) -> str:
    """An explicit dtype both servers can be given: `auto` becomes what kvrelay's own `auto` picks here."""
    if dtype != "auto":
        return dtype
    from kvrelay.engine.auto_dtype import auto_dtype

    return str(auto_dtype("cpu")).removeprefix("torch.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["disagg", "routing", "vllm", "llamacpp", "kvcache", "all"], default="all",
                   help="disagg: colocated vs 1P+1D; routing: round_robin vs cache_aware over several prefill "
                        "nodes; vllm: `vllm serve` vs `kvrelay up`; llamacpp: `llama-server` vs `kvrelay up "
                        "--quantization gguf` on the same GGUF; kvcache: the model dtype's KV cache vs "
                        "--kv-cache-dtype in the same memory (all: disagg and routing)")
    p.add_argument("--model", default="default", help="passed to `kvrelay up --model` (and its folder to vLLM)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="passed to `kvrelay up --dtype`; vllm scenario: both servers get it, `auto` resolved to "
                        "what kvrelay picks on this machine")
    p.add_argument("--prefill-nodes", type=int, default=3, help="routing scenario: prefill nodes")
    p.add_argument("--decode-nodes", type=int, default=1, help="routing scenario: decode nodes")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="bytes of KV cache per node (default: "
                        + ", ".join(f"{k} {v // 2**20} MiB" for k, v in KV_CACHE_DEFAULTS.items())
                        + "; kept small where several nodes share this machine's memory)")
    p.add_argument("--vllm-python", default=None,
                   help="vllm scenario: the vLLM venv's python (default: $KVRELAY_VLLM_PYTHON, then the peer kit's)")
    p.add_argument("--llama-server", default=None,
                   help="llamacpp scenario: llama.cpp's llama-server (default: $KVRELAY_LLAMACPP_BIN's, then the "
                        "peer kit's)")
    p.add_argument("--kv-cache-dtype", default="int8", choices=[d for d in KV_CACHE_DTYPES if d != "auto"],
                   help="kvcache scenario: the quantized cache of arm B")
    p.add_argument("--rounds", type=int, default=2,
                   help="vllm, llamacpp and kvcache scenarios: rounds of the pair, run A B, B A, ... (2: ABBA)")
    p.add_argument("--tokenizer", default=None,
                   help="measure dataset lengths in this tokenizer's tokens (default: the model's, when local)")
    p.add_argument("--serve-args", default=None,
                   help="extra `kvrelay bench serve` flags, appended to the scenario's defaults (later wins): "
                        + "; ".join(f"{k}: {v}" for k, v in SERVE_DEFAULTS.items()))
    p.add_argument("--output-dir", default="bench/results", help="where JSON, PNG and server logs go")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
