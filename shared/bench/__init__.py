"""Every benchmark, registered the same way under `kvrelay bench <name>`.

A benchmark module has a docstring (its --help), `HELP` (one line for the command list), `add_arguments(p)`
and `run(args) -> exit code`; it prints JSON, writes it under bench/results/ (scratch; figures the docs cite
are copied to docs/results/), and, where it has a baseline, runs it in the same invocation.
`python -m shared.bench.<module>` runs one standalone.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.args import HelpFormatter

BENCHMARKS: dict[str, str] = {
    "throughput": "shared.bench.throughput",
    "serve": "shared.bench.serve",
    "fleet": "shared.bench.fleet",
    "ttft": "shared.bench.ttft",
    "kv-transfer": "shared.bench.kv_transfer",
    "routing": "shared.bench.routing",
    "index-lookup": "shared.bench.index_lookup",
    "decode-attention": "shared.bench.decode_attention",
    "structured": "shared.bench.structured",
    "spec-decode": "shared.bench.spec_decode",
    "soak": "shared.bench.soak",
}


def register(subparsers) -> None:
    """Add `bench` and its benchmarks to the `kvrelay` subcommands."""
    p = subparsers.add_parser("bench", help="benchmarks", description=__doc__, formatter_class=HelpFormatter)
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        b = bench.add_parser(name, help=module.HELP, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(b)
        b.set_defaults(func=module.run)


def parser(module_name: str) -> argparse.ArgumentParser:
    """The flags of one benchmark module, as `kvrelay bench <name>` has them."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    real_name = module.__spec__.name if module.__spec__ is not None else module_name  # not "__main__"
    name = next((n for n, m in BENCHMARKS.items() if m == real_name), real_name)
    p = argparse.ArgumentParser(prog=f"kvrelay bench {name}", description=module.__doc__,
                                formatter_class=HelpFormatter)
    module.add_arguments(p)
    return p


def standalone(module_name: str, argv: list[str] | None = None) -> int:
    """`python -m shared.bench.<module>`: parse the flags, set up logging, run."""
    from shared.log import configure_logging

    args = parser(module_name).parse_args(argv)
    configure_logging()
    return sys.modules[module_name].run(args)
