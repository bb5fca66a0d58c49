"""The `kvrelay` command line: the only place (with kvrelay.bench) that imports the roles."""

from __future__ import annotations

import argparse
import sys

from kvrelay.cli.log import configure_logging
from kvrelay.common.system import huge_pages_for_tensors

DESCRIPTION = """kvrelay: disaggregated LLM serving (OpenAI gateway, prefill and decode pools, paged KV cache).

Commands:
  up         bring up a whole fleet on this machine (Redis, prefill and decode nodes, gateway)
  gateway    the OpenAI-compatible gateway (HTTP) and its gRPC API
  prefill    a prefill node
  decode     a decode node
  generate   run the engine offline on a prompt and print the completion
  bench      benchmarks (engine throughput vs transformers and vLLM, KV transfer, serving, routing, TTFT, ...)
"""


def build_parser() -> argparse.ArgumentParser:
    from kvrelay.cli import bench, gateway, generate, node, up

    parser = argparse.ArgumentParser(prog="kvrelay", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    bench.register(sub)
    up.register(sub)
    gateway.register(sub)
    node.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    # torch settles huge pages at its first allocation of 2 MiB or more, which a benchmark's GEMM ceiling makes
    # before any engine exists (the engine's own call would then be too late); the children inherit it.
    huge_pages_for_tensors()
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"kvrelay: error: {e}", file=sys.stderr)
        return 2

