"""Llama 3.x JSON calls (the "JSON based tool calling" of its chat template): the whole reply is one or
more call objects, separated by ';', optionally after <|python_tag|>:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that does not start with '{' (after the tag and whitespace) is plain content.
"""

from __future__ import annotations

import json

from kvrelay.gateway.tool_parsers.base import Scan, ToolParser
from kvrelay.gateway.tool_parsers.json_scan import NotACall, scan_call, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def format_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_ws(text, 0)
        body = text[start:]
        if body.startswith(TAG):
            start = skip_ws(text, start + len(TAG))
        elif not final and (not body or TAG.startswith(body)):
            return Scan("")  # undecided yet
        if start >= len(text):
            return Scan("" if not final else text)
        if text[start] != "{":
            return Scan(text)
        calls = []
        pos = start
        try:
            while True:
                call, end = scan_call(text, pos, final)
                calls.append(call)
                if end is None:
                    break
                pos = skip_ws(text, end)
                if pos >= len(text) or text[pos] != ";":
                    break
                pos += 1
        except NotACall:
            pass
        if final and not any(c.name for c in calls):
            return Scan(text)  # JSON, but not a call: the reply is content
        return Scan("", calls)
