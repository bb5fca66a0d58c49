"""Benchmarks: `register(subparsers)` adds throughput, serve, ttft, fleet, decode-attention and routing to
`kvrelay bench`."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add `throughput` to the `bench` subparsers; its func runs the benchmark and returns an exit code."""
    from shared.bench import throughput

    p = subparsers.add_parser(
        "throughput",
        help="engine throughput on a mixed real-text workload, vs the matmul ceiling and optionally HF",
        description=throughput.__doc__,
        formatter_class=throughput.HelpFormatter,
    )
    throughput.add_arguments(p)
    p.set_defaults(func=throughput.run)
    __import__("shared.bench.serve", fromlist=["register"]).register(subparsers)  # `bench serve`
    __import__("shared.bench.ttft", fromlist=["register"]).register(subparsers)  # `bench ttft`
    __import__("shared.bench.fleet", fromlist=["register"]).register(subparsers)  # `bench fleet`
    __import__("shared.bench.decode_attention", fromlist=["register"]).register(subparsers)
    from shared.bench import routing

    r = subparsers.add_parser("routing", help="routing decision time, cache_aware vs round_robin, gateway overhead",
                              description=routing.__doc__, formatter_class=routing.argparse.RawDescriptionHelpFormatter)
    routing.add_arguments(r)
    r.set_defaults(func=routing.run)
