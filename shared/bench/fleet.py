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

    kvrelay bench fleet --scenario disagg
    kvrelay bench fleet --scenario routing --prefill-nodes 3 --serve-args "--num-requests 96 --tenants 12"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.bench import parser as bench_parser
from shared.bench import serve, serve_report
from shared.system import free_port

logger = logging.getLogger(__name__)

# Sized so that one arm takes a few minutes on a 2-core machine with the default model.
SERVE_DEFAULTS = {
    "disagg": "--dataset random --concurrency 4 --num-requests 48 --warmup 2 --min-input 64 --max-input 768 "
              "--min-output 16 --max-output 96 --ignore-eos",
    "routing": "--dataset multi-tenant --tenants 8 --system-len 768 --concurrency 4 --num-requests 64 --warmup 0 "
               "--min-input 16 --max-input 96 --max-tokens 16 --ignore-eos",
}


@dataclass(frozen=True)
class Arm:
    label: str
    up_flags: tuple[str, ...]


def scenario_arms(scenario: str, prefill_nodes: int) -> tuple[Arm, Arm]:
    """(A, B): the baseline first, the configuration under test second."""
    if scenario == "disagg":
        return Arm("colocated", ("--colocated",)), Arm("disagg-1p1d", ("--prefill", "1", "--decode", "1"))
    nodes = ("--prefill", str(prefill_nodes), "--decode", "1")
    return (Arm(f"round_robin-{prefill_nodes}p1d", (*nodes, "--routing-policy", "round_robin")),
            Arm(f"cache_aware-{prefill_nodes}p1d", (*nodes, "--routing-policy", "cache_aware")))


class FleetProcess:
    """One `kvrelay up` child; a context manager that always stops it."""

    def __init__(self, flags: list[str], log_path: Path, ready_timeout: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.argv = [sys.executable, "-m", "shared.cli", "up", "--port", str(self.port),
                     "--grpc-port", str(free_port()), *flags]
        self.log_path, self.ready_timeout = log_path, ready_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> FleetProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting: %s (log: %s)", shlex.join(self.argv[2:]), self.log_path)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fleet exited with {self.proc.returncode}:\n{self._tail()}")
            # kvrelay up prints its banner once the gateway routes to every node
            if "kvrelay is up" in self._tail(200):
                logger.info("fleet ready at %s", self.base_url)
                return
            time.sleep(0.5)
        raise TimeoutError(f"the fleet was not ready within {self.ready_timeout:g} s:\n{self._tail()}")

    def stop(self, timeout_s: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # `kvrelay up` drains and stops its children
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("fleet did not stop within %g s; killing its process group", timeout_s)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def serve_namespace(serve_args: list[str], base_url: str, label: str, output: Path) -> argparse.Namespace:
    args = bench_parser(serve.__name__).parse_args([*serve_args, "--base-url", base_url, "--label", label,
                                            "--output", str(output)])
    serve.check_args(args)
    return args


def run_arm(arm: Arm, args: argparse.Namespace, serve_args: list[str]) -> Path:
    out_dir = Path(args.output_dir)
    output = out_dir / f"fleet-{arm.label}.json"
    flags = ["--model", args.model, *arm.up_flags]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    with FleetProcess(flags, out_dir / f"fleet-{arm.label}.log", args.ready_timeout) as fleet:
        sargs = serve_namespace(serve_args, fleet.base_url, arm.label, output)
        result = serve.measure(sargs)
        result["fleet"] = {"kvrelay_up_flags": flags, "cpu_count": os.cpu_count()}
    serve_report.save(result, output, plot=not args.no_plot)
    print(json.dumps({k: result[k] for k in ("label", "completed", "failed", "request_throughput",
                                             "output_throughput", "prefix_hit_ratio")}
                     | {m: result[m]["p50"] for m in ("ttft_ms", "itl_ms", "e2e_ms")}, indent=1))
    if not result["completed"]:
        raise RuntimeError(f"{arm.label}: no request completed; errors: {result['errors']}")
    return output


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tokenizer = args.tokenizer
    if tokenizer is None and (args.model == "default" or os.path.isdir(args.model)):
        from shared.model_resolve import resolve_model

        tokenizer = str(resolve_model(args.model).path)  # dataset lengths in the served model's tokens
    scenarios = ["disagg", "routing"] if args.scenario == "all" else [args.scenario]
    for scenario in scenarios:
        serve_args = shlex.split(SERVE_DEFAULTS[scenario]) + shlex.split(args.serve_args or "")
        if tokenizer and "--tokenizer" not in serve_args:
            serve_args += ["--tokenizer", tokenizer]
        a, b = scenario_arms(scenario, args.prefill_nodes)
        path_a, path_b = run_arm(a, args, serve_args), run_arm(b, args, serve_args)
        serve_report.run_compare(str(path_a), str(path_b),
                                 str(Path(args.output_dir) / f"fleet-{scenario}-compare.json"), not args.no_plot)
    return 0


HELP = "kvrelay up + bench serve: colocated vs disaggregated, routing policies"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["disagg", "routing", "all"], default="all",
                   help="disagg: colocated vs 1P+1D; routing: round_robin vs cache_aware over several prefill nodes")
    p.add_argument("--model", default="default", help="passed to `kvrelay up --model`")
    p.add_argument("--prefill-nodes", type=int, default=3, help="routing scenario: prefill nodes (one decode node)")
    p.add_argument("--kv-cache-memory", type=int, default=512 * 1024**2,
                   help="bytes of KV cache per node (kept small: several nodes share this machine's memory)")
    p.add_argument("--tokenizer", default=None,
                   help="measure dataset lengths in this tokenizer's tokens (default: the model's, when local)")
    p.add_argument("--serve-args", default=None,
                   help="extra `kvrelay bench serve` flags, appended to the scenario's defaults (later wins): "
                        + "; ".join(f"{k}: {v}" for k, v in SERVE_DEFAULTS.items()))
    p.add_argument("--output-dir", default="bench/results", help="where JSON, PNG and fleet logs go")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a fleet may take to come up")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")


if __name__ == "__main__":
    from shared.bench import standalone

    raise SystemExit(standalone(__name__))
