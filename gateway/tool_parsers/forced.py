"""Outputs of forced tool choices, whose shape the grammar guarantees (gateway.tools builds it):

- `required`: a JSON list of {"name": ..., "parameters": {...}} objects, one or more calls;
- a named function: the arguments object alone.
"""

from __future__ import annotations

from kvrelay.gateway.tool_parsers.base import Scan, ToolParser
from kvrelay.gateway.tool_parsers.json_scan import NotACall, PartialCall, scan_call_list, skip_ws, value_end


class RequiredToolParser(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        try:
            return Scan("", scan_call_list(text, 0, final, arg_keys=("parameters", "arguments")))
        except NotACall:
            return Scan("" if not final else text)


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_ws(text, 0)
        if start >= len(text):
            return Scan("", [PartialCall(self.function, "", False, final)])
        end = value_end(text, start, final)
        args = text[start:] if end is None else text[start:end]
        return Scan("", [PartialCall(self.function, args, end is not None, end is not None or final)])
