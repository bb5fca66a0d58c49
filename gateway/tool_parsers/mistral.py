"""Mistral calls: content, then [TOOL_CALLS] and the calls, either as a JSON list (v3 tokenizers)

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or one call per marker as name[ARGS]arguments (v11+ tokenizers):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

[TOOL_CALLS] is a special token in Mistral's vocabularies, so the text is detokenized with special tokens
kept. Call ids are 9 alphanumerics, as Mistral's chat template requires.
"""

from __future__ import annotations

import json

from kvrelay.gateway.tool_parsers.base import Scan, ToolParser, mistral_call_id
from kvrelay.gateway.tool_parsers.json_scan import (
    NotACall,
    PartialCall,
    partial_marker_len,
    scan_call,
    scan_call_list,
    skip_ws,
    value_end,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False

    def new_call_id(self) -> str:
        return mistral_call_id()

    def format_call(self, name: str, arguments: str) -> str:
        return f'{MARKER}[{{"name": {json.dumps(name)}, "arguments": {arguments}}}]'

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(MARKER)
        if first < 0:
            hold = 0 if final else partial_marker_len(text, MARKER)
            return Scan(text[: len(text) - hold])
        calls: list[PartialCall] = []
        pos = first
        try:
            while pos >= 0:
                start = skip_ws(text, pos + len(MARKER))
                nxt = text.find(MARKER, start)
                segment = text[start:] if nxt < 0 else text[start:nxt]
                done = final or nxt >= 0
                if segment.startswith("["):
                    calls += scan_call_list(segment, 0, done)
                elif segment.startswith("{"):
                    calls.append(scan_call(segment, 0, done)[0])
                elif segment:
                    calls.append(_named_args(segment, done))
                pos = nxt
        except NotACall:
            pass
        return Scan(text[:first], calls)


def _named_args(segment: str, final: bool) -> PartialCall:
    at = segment.find(ARGS)
    if at < 0:
        return PartialCall(None, "", False, False)
    name = segment[:at].strip()
    if not name:
        raise NotACall("no function name before [ARGS]")
    start = skip_ws(segment, at + len(ARGS))
    if start >= len(segment):
        return PartialCall(name, "", False, False)
    end = value_end(segment, start, final)
    args = segment[start:] if end is None else segment[start:end]
    return PartialCall(name, args, end is not None, end is not None)
