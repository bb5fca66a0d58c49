"""The `kvrelay` command line: the only place (with kvrelay.bench) that imports the roles.

Only the command being run builds its parser (`kvrelay up` imports neither torch nor the benchmarks, so its
checks answer within a second). Every error is one line, `kvrelay <command>: error: ...`, with exit code 2: a
bad value, a check before start-up (kvrelay.cli.args.UsageError), or a flag the command does not know, which
says where that flag lives (kvrelay.cli.unknown_flags).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvrelay.cli.args import CommandParser, UsageError
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
  sim, plan  simulate a whole fleet on a simulated clock; size prefill and decode pools for SLOs
"""

# Each command's module (its `register(subparsers)` adds it); in the order `kvrelay --help` lists them.
_MODULES = {"generate": "generate", "bench": "bench", "up": "up", "gateway": "gateway", "prefill": "node",
            "decode": "node"}
_MODULES.update({"sim": "sim", "plan": "sim"})
_LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, ERROR"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `kvrelay` parser: with every command, or with `command`'s only (what running it needs)."""
    parser = CommandParser(prog="kvrelay", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", help=_LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [_MODULES[command]] if command in _MODULES else list(dict.fromkeys(_MODULES.values()))
    for name in modules:
        importlib.import_module(f"kvrelay.cli.{name}").register(sub)
    for p in sub.choices.values():  # after the command too, as vLLM users type it
        p.add_argument("--log-level", default=argparse.SUPPRESS, help=_LOG_LEVEL_HELP)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command named in argv (the first word that is not a top-level option or its value)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--log-level":
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The namespace of argv; UsageError for what the command cannot take (an unknown flag: with where it lives)."""
    command = _command_of(argv)
    parser = build_parser(command)
    args, extras = parser.parse_known_args(argv)
    if extras:
        from kvrelay.cli.unknown_flags import explain

        own = _subparsers(parser)[args.command]

        def others() -> dict[str, argparse.ArgumentParser]:  # built only when the flag is no typo of ours
            return {name: _subparsers(build_parser(name))[name]
                    for name in ("up", "gateway", "prefill", "decode", "generate") if name != args.command}

        raise UsageError(explain(args.command, extras, own, others), prog=own.prog)
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(parser._subparsers._group_actions[0].choices)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    prog = f"kvrelay {command}" if command in _MODULES else "kvrelay"
    try:
        args = parse(argv)
        configure_logging(args.log_level)
        # torch settles huge pages at its first allocation of 2 MiB or more, which a benchmark's GEMM ceiling
        # makes before any engine exists (the engine's own call would then be too late); the children inherit it.
        huge_pages_for_tensors()
        return args.func(args) or 0
    except UsageError as e:
        print(f"{e.prog or prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a configuration the command refused before starting
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handling: no traceback
        return 130
