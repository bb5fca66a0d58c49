"""Pieces of the command line that only the CLI uses: the parser class (one-line errors), the help format, flags
read from config records, and the error every check before start-up raises."""

from __future__ import annotations

import argparse

from kvrelay.common.system import parse_cores


class UsageError(ValueError):
    """A command line that cannot run: printed as one line, `<prog>: error: <message>`, and exit code 2.
    `flag` names the flag at fault when there is one (the message then starts with it)."""

    def __init__(self, message: str, flag: str | None = None, prog: str | None = None) -> None:
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag
        self.prog = prog


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors carrying its prog (`kvrelay up`), so that main() prints one
    line under the command that failed instead of argparse's usage block."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message, prog=self.prog)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout (examples, numbered steps) and shows the defaults that are set (not
    None, not on/off flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def add_field_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup, defaults: object,
                    helps: dict[str, str]) -> None:
    """A flag for each field named in `helps` (`refresh_interval` -> `--refresh-interval`), with the help given;
    its default is the field's value in `defaults` (a config record), its type that value's type (a bool field:
    `--name` and `--no-name`)."""
    for name, text in helps.items():
        value = getattr(defaults, name)
        if isinstance(value, bool):
            group.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=value,
                               help=text)
            continue
        group.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=text)


def add_tls_flags(group) -> None:
    """The fleet's mutual TLS (kvrelay.common.tls): one set of flags for gateways and nodes."""
    group.add_argument("--tls-ca-file", default=None, metavar="PEM",
                       help="the fleet's CA certificate: with the two below, gRPC between gateways and nodes is "
                            "mutual TLS, and peers without a certificate the CA signed are refused")
    group.add_argument("--tls-cert-file", default=None, metavar="PEM", help="this process's certificate")
    group.add_argument("--tls-key-file", default=None, metavar="PEM", help="this process's private key")


def core_list(text: str) -> tuple[int, ...]:
    """argparse type of a core list (taskset's form, 0-3,8)."""
    try:
        return parse_cores(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flag_name(field: str) -> str:
    """The flag of a config field: `kv_cache_memory` -> `--kv-cache-memory`."""
    return "--" + field.replace("_", "-")
