"""`kvrelay bench <name>`: every benchmark registered the same way (kvrelay.bench says what a benchmark
module provides)."""

from __future__ import annotations

import importlib

from kvrelay.bench import BENCHMARKS
from kvrelay.cli.args import HelpFormatter


def register(subparsers) -> None:
    """Add `bench` and its benchmarks to the `kvrelay` subcommands."""
    import kvrelay.bench

    p = subparsers.add_parser("bench", help="benchmarks", description=kvrelay.bench.__doc__,
                              formatter_class=HelpFormatter)
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        b = bench.add_parser(name, help=module.HELP, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(b)
        b.set_defaults(func=module.run)
