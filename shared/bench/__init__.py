"""Every benchmark, registered the same way under `kvrelay bench <name>` (kvrelay.cli.bench).

A benchmark module has a docstring (its --help), `HELP` (one line for the command list), `add_arguments(p)`
and `run(args) -> exit code`; it prints JSON, writes it under bench/results/ (scratch; figures the docs cite
are copied to docs/results/), and, where it has a baseline, runs it in the same invocation.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, str] = {
    "throughput": "kvrelay.bench.throughput",
    "serve": "kvrelay.bench.serve",
    "fleet": "kvrelay.bench.fleet",
    "ttft": "kvrelay.bench.ttft",
    "kv-transfer": "kvrelay.bench.kv_transfer",
    "routing": "kvrelay.bench.routing",
    "index-lookup": "kvrelay.bench.index_lookup",
    "decode-attention": "kvrelay.bench.decode_attention",
    "decode-step": "kvrelay.bench.decode_step",
    "structured": "kvrelay.bench.structured",
    "spec-decode": "kvrelay.bench.spec_decode",
    "soak": "kvrelay.bench.soak",
    "lora": "kvrelay.bench.lora",
    "tenants": "kvrelay.bench.tenants",
    "accuracy": "kvrelay.bench.accuracy",
    "pooling": "kvrelay.bench.pooling",
    "multiturn": "kvrelay.bench.multiturn",
}


def parse_args(module_name: str, argv: list[str]) -> argparse.Namespace:
    """The flags of one benchmark module parsed as `kvrelay bench <name>` would (for a benchmark that runs
    another, and for tests)."""
    module = importlib.import_module(module_name)
    p = argparse.ArgumentParser(prog=f"kvrelay bench {module_name.rpartition('.')[2]}")
    module.add_arguments(p)
    return p.parse_args(argv)
