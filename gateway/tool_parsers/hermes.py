"""Hermes-style calls, as Qwen2.5 / Qwen3 and Hermes models write them:

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any text before the first <tool_call> is content; each block holds one call.
"""

from __future__ import annotations

from kvrelay.gateway.tool_parsers.base import Scan, ToolParser
from kvrelay.gateway.tool_parsers.json_scan import NotACall, partial_marker_len, scan_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            hold = 0 if final else partial_marker_len(text, START)
            return Scan(text[: len(text) - hold])
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(START)
            close = text.find(END, body_start)
            body = text[body_start:] if close < 0 else text[body_start:close]
            try:
                call, end = scan_call(body, 0, final or close >= 0)
            except NotACall:
                break  # not JSON of a call: what came before stands
            calls.append(call)
            if end is None or close < 0:
                break
            pos = text.find(START, close + len(END))
        return Scan(text[:first], calls)
