"""Tool-call parsers for tool_choice "auto", by vLLM's --tool-call-parser names.

    parser = create_tool_parser("hermes")
    parser.parse(text)             # ParsedOutput(content, calls)
    stream = parser.stream()       # stream.feed(delta) -> StreamDelta(content, call deltas)
"""

from __future__ import annotations

from kvrelay.gateway.tool_parsers.base import (
    CallDelta,
    ParsedCall,
    ParsedOutput,
    Scan,
    StreamDelta,
    ToolCallStream,
    ToolParser,
)
from kvrelay.gateway.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvrelay.gateway.tool_parsers.hermes import HermesToolParser
from kvrelay.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from kvrelay.gateway.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = ["CallDelta", "NamedToolParser", "ParsedCall", "ParsedOutput", "RequiredToolParser", "Scan",
           "StreamDelta", "TOOL_PARSERS", "ToolCallStream", "ToolParser", "create_tool_parser"]


def create_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None
