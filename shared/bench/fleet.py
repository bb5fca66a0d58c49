"""`kvrelay bench fleet`: bring up whole fleets with `kvrelay up` and run `kvrelay bench serve` against each.

Lifecycle of one arm (a fleet configuration):
1. Start `kvrelay up` with the arm's flags on free ports, in its own session; its log goes beside the results.
2. Wait for its banner, printed once the gateway routes to every node (a fleet that exits fails the arm,
   with its log's tail).
3. Run the serve benchmark in this process and save its JSON and plots as bench/results/fleet-<arm>.json.
4. SIGTERM the fleet and wait for it to exit (the process group is killed if it does not drain in time).
Each arm starts cold (fresh processes, empty caches), so arms never share prefix-cache state.

Scenarios, each a pair of arms compared with `bench serve --compare` (B/A ratios, a combined CDF plot):
  disagg   A = colocated (one engine prefills and decodes), B = 1 prefill + 1 decode node; random dataset
  routing  A = round_robin, B = cache_aware, over N prefill nodes + 1 decode node; multi-tenant dataset
  vllm     A = `vllm serve` (vLLM's CPU build from its venv, as `bench throughput --baseline vllm` finds it),
           B = `kvrelay up` placed as it chooses; both in one dtype, concurrency 32 on 128 requests of 16-1,024
           input and 8-256 output tokens. Run A B B A (--rounds 2), since a shared machine drifts: each round's
           pair is compared, and the mean ratio is printed last.

    kvrelay bench fleet --scenario disagg
    kvrelay bench fleet --scenario routing --prefill-nodes 3 --serve-args "--num-requests 96 --tenants 12"
    kvrelay bench fleet --scenario vllm --dtype float32
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvrelay.bench import parse_args, serve, serve_report, vllm_baseline
from kvrelay.bench.server_process import ServerProcess
from kvrelay.common.system import free_port

logger = logging.getLogger(__name__)

# Sized so that one arm takes a few minutes on a 2-core machine with the default model.
SERVE_DEFAULTS = {
    "disagg": "--dataset random --concurrency 4 --num-requests 48 --warmup 2 --min-input 64 --max-input 768 "
              "--min-output 16 --max-output 96 --ignore-eos",
    "routing": "--dataset multi-tenant --tenants 8 --system-len 768 --concurrency 4 --num-requests 64 --warmup 0 "
               "--min-input 16 --max-input 96 --max-tokens 16 --ignore-eos",
    # The speed issue's served workload: its lengths, at its concurrency.
    "vllm": "--dataset random --concurrency 32 --num-requests 128 --warmup 2 --min-input 16 --max-input 1024 "
            "--min-output 8 --max-output 256 --ignore-eos",
}
# KV cache per node: several nodes share the machine in the fleet scenarios; against vLLM, one engine each,
# given as much as the peer kit gives vLLM's CPU build.
KV_CACHE_DEFAULTS = {"disagg": 512 * 2**20, "routing": 512 * 2**20, "vllm": 2 * 2**30}


class Server(enum.Enum):
    KVRELAY = "kvrelay up"
    VLLM = "vllm serve"


@dataclass(frozen=True)
class Arm:
    label: str
    up_flags: tuple[str, ...] = ()
    server: Server = Server.KVRELAY


def scenario_arms(scenario: str, prefill_nodes: int) -> tuple[Arm, Arm]:
    """(A, B): the baseline first, the configuration under test second."""
    if scenario == "vllm":
        return Arm("vllm-serve", server=Server.VLLM), Arm("kvrelay-up")
    if scenario == "disagg":
        return Arm("colocated", ("--colocated",)), Arm("disagg-1p1d", ("--prefill", "1", "--decode", "1"))
    nodes = ("--prefill", str(prefill_nodes), "--decode", "1")
    return (Arm(f"round_robin-{prefill_nodes}p1d", (*nodes, "--routing-policy", "round_robin")),
            Arm(f"cache_aware-{prefill_nodes}p1d", (*nodes, "--routing-policy", "cache_aware")))


class FleetProcess(ServerProcess):
    """One `kvrelay up` child on free ports."""

    def __init__(self, flags: list[str], log_path: Path, ready_timeout: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        super().__init__([sys.executable, "-m", "kvrelay.cli", "up", "--port", str(self.port),
                          "--grpc-port", str(free_port()), *flags], log_path, ready_timeout)

    def is_ready(self) -> bool:
        return "kvrelay is up" in self.tail(200)  # printed once the gateway routes to every node


def serve_namespace(serve_args: list[str], base_url: str, label: str, output: Path) -> argparse.Namespace:
    args = parse_args(serve.__name__, [*serve_args, "--base-url", base_url, "--label", label,
                                            "--output", str(output)])
    serve.check_args(args)
    return args


def server_for(arm: Arm, args: argparse.Namespace, log_path: Path) -> tuple[ServerProcess, dict]:
    """The arm's server (not started yet) and what to record about it."""
    if arm.server is Server.VLLM:
        model = args.resolved_model
        python = vllm_baseline.find_python(args.vllm_python)
        server = vllm_baseline.VllmServer(python, str(model.path), model.model_id, args.dtype, free_port(),
                                          kv_cache_bytes=args.kv_cache_memory, log_path=log_path,
                                          ready_timeout=args.ready_timeout)
        return server, {"vllm_serve_argv": server.argv[1:]}
    flags = ["--model", args.model, *arm.up_flags]
    if args.dtype != "auto":
        flags += ["--dtype", args.dtype]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return FleetProcess(flags, log_path, args.ready_timeout), {"kvrelay_up_flags": flags}


def run_arm(arm: Arm, args: argparse.Namespace, serve_args: list[str]) -> tuple[Path, dict]:
    """The arm's serve run: where its JSON went, and the result."""
    out_dir = Path(args.output_dir)
    output = out_dir / f"fleet-{arm.label}.json"
    server, record = server_for(arm, args, out_dir / f"fleet-{arm.label}.log")
    with server:
        sargs = serve_namespace(serve_args, server.base_url, arm.label, output)
        result = serve.measure(sargs)
        result["fleet"] = {**record, "cpu_count": os.cpu_count()}
    serve_report.save(result, output, plot=not args.no_plot)
    print(json.dumps({k: result[k] for k in ("label", "completed", "failed", "request_throughput",
                                             "output_throughput", "prefix_hit_ratio")}
                     | {m: result[m]["p50"] for m in ("ttft_ms", "itl_ms", "e2e_ms")}, indent=1))
    if not result["completed"]:
        raise RuntimeError(f"{arm.label}: no request completed; errors: {result['errors']}")
    return output, result


def round_arms(a: Arm, b: Arm, rounds: int) -> list[tuple[Arm, Arm]]:
    """Each round's (A, B), labelled by round when there are several; they run A B, B A, A B, ..."""
    if rounds == 1:
        return [(a, b)]
    return [(replace(a, label=f"{a.label}-{r}"), replace(b, label=f"{b.label}-{r}")) for r in range(1, rounds + 1)]


def play_order(pairs: list[tuple[Arm, Arm]]) -> list[Arm]:
    """A B, B A, A B, ...: each arm runs first as often as last, so a drifting machine favours neither."""
    return [arm for r, (a, b) in enumerate(pairs) for arm in ((a, b) if r % 2 == 0 else (b, a))]


def resolved_dtype(dtype: str) -> str:
    """An explicit dtype both servers can be given: `auto` becomes what kvrelay's own `auto` picks here."""
    if dtype != "auto":
        return dtype
    from kvrelay.engine.auto_dtype import auto_dtype

    return str(auto_dtype("cpu")).removeprefix("torch.")


def run_scenario(scenario: str, args: argparse.Namespace, serve_args: list[str]) -> dict:
    out_dir = Path(args.output_dir)
    rounds = args.rounds if scenario == "vllm" else 1
    pairs = round_arms(*scenario_arms(scenario, args.prefill_nodes), rounds)
    runs = {arm.label: run_arm(arm, args, serve_args) for arm in play_order(pairs)}
    summary = []
    for r, (a, b) in enumerate(pairs, start=1):
        (path_a, ra), (path_b, rb) = runs[a.label], runs[b.label]
        suffix = f"-{r}" if rounds > 1 else ""
        serve_report.run_compare(str(path_a), str(path_b), str(out_dir / f"fleet-{scenario}-compare{suffix}.json"),
                                 not args.no_plot)
        summary.append({"a": a.label, "b": b.label, "output_throughput": [ra["output_throughput"],
                                                                          rb["output_throughput"]],
                        "ttft_p90_ms": [ra["ttft_ms"]["p90"], rb["ttft_ms"]["p90"]]})
    a_total = sum(s["output_throughput"][0] for s in summary)
    b_total = sum(s["output_throughput"][1] for s in summary)
    return {"scenario": scenario, "rounds": summary,
            "mean_output_throughput_b_over_a": b_total / a_total if a_total else None}


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tokenizer = args.tokenizer
    if tokenizer is None and (args.model == "default" or os.path.isdir(args.model)):
        from kvrelay.model_files.resolve import resolve_model

        tokenizer = str(resolve_model(args.model).path)  # dataset lengths in the served model's tokens
    scenarios = ["disagg", "routing"] if args.scenario == "all" else [args.scenario]
    for scenario in scenarios:
        serve_args = shlex.split(SERVE_DEFAULTS[scenario]) + shlex.split(args.serve_args or "")
        if tokenizer and "--tokenizer" not in serve_args:
            serve_args += ["--tokenizer", tokenizer]
        scenario_args = argparse.Namespace(**vars(args))
        scenario_args.kv_cache_memory = args.kv_cache_memory or KV_CACHE_DEFAULTS[scenario]
        if scenario == "vllm":
            from kvrelay.model_files.resolve import resolve_model

            scenario_args.dtype = resolved_dtype(args.dtype)  # the same explicit dtype for both servers
            scenario_args.resolved_model = resolve_model(args.model)  # vLLM is given its HF folder
        print(json.dumps(run_scenario(scenario, scenario_args, serve_args), indent=1))
    return 0


HELP = "kvrelay up + bench serve: colocated vs disaggregated, routing policies, vs `vllm serve`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["disagg", "routing", "vllm", "all"], default="all",
                   help="disagg: colocated vs 1P+1D; routing: round_robin vs cache_aware over several prefill "
                        "nodes; vllm: `vllm serve` vs `kvrelay up` (all: disagg and routing)")
    p.add_argument("--model", default="default", help="passed to `kvrelay up --model` (and its folder to vLLM)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="passed to `kvrelay up --dtype`; vllm scenario: both servers get it, `auto` resolved to "
                        "what kvrelay picks on this machine")
    p.add_argument("--prefill-nodes", type=int, default=3, help="routing scenario: prefill nodes (one decode node)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache per node (default: "
                        + ", ".join(f"{k} {v // 2**20} MiB" for k, v in KV_CACHE_DEFAULTS.items())
                        + "; kept small where several nodes share this machine's memory)")
    p.add_argument("--vllm-python", default=None,
                   help="vllm scenario: the vLLM venv's python (default: $KVRELAY_VLLM_PYTHON, then the peer kit's)")
    p.add_argument("--rounds", type=int, default=2,
                   help="vllm scenario: rounds of the pair, run A B, B A, ... (2: ABBA)")
    p.add_argument("--tokenizer", default=None,
                   help="measure dataset lengths in this tokenizer's tokens (default: the model's, when local)")
    p.add_argument("--serve-args", default=None,
                   help="extra `kvrelay bench serve` flags, appended to the scenario's defaults (later wins): "
                        + "; ".join(f"{k}: {v}" for k, v in SERVE_DEFAULTS.items()))
    p.add_argument("--output-dir", default="bench/results", help="where JSON, PNG and fleet logs go")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")

