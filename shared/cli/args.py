"""Pieces of the command line that only the CLI uses."""

from __future__ import annotations

import argparse


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
    its default is the field's value in `defaults` (a config record), its type that value's type."""
    for name, text in helps.items():
        value = getattr(defaults, name)
        group.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=text)
