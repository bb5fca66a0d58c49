"""The tool parser interface: find the tool calls in a model's output, complete or still streaming.

A parser reads the whole output so far and reports the content before the calls and each call it can see
(`Scan`). Both must only grow as the text grows: `ToolCallStream` diffs successive scans into OpenAI's
streaming deltas (a call's id and name first, then its arguments in pieces, with its index), and the
non-streaming answer is the final scan.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvrelay.gateway.tool_parsers.json_scan import PartialCall


@dataclass(frozen=True)
class Scan:
    content: str  # text for the client before (outside) the calls
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str | None = None  # with the name, in a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


class ToolParser(ABC):
    name = "base"
    skip_special_tokens = True  # False when the format's markers are special tokens the text must keep

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The content and calls visible in `text`; `final`: no more text will come."""

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def format_call(self, name: str, arguments: str) -> str:
        """A call written the way this format's model writes it (history for templates without tools)."""
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'

    def parse(self, text: str) -> ParsedOutput:
        """The calls written out in full (one cut short by max_tokens is left out; the text stays content)."""
        scan = self.scan(text, final=True)
        calls = [ParsedCall(self.new_call_id(), c.name, c.final_arguments()) for c in scan.calls
                 if c.name and (c.complete or c.arguments_done)]
        content = scan.content if scan.content.strip() else None
        return ParsedOutput(content, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One choice's streaming state: feed text deltas, get content and call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._sent: list[tuple[str, int]] = []  # per call: (id, arguments characters sent)

    @property
    def called(self) -> bool:
        return bool(self._sent)

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        scan = self.parser.scan(self.text, final)
        content = scan.content[self._content_sent :] if not self._sent else ""
        self._content_sent = max(self._content_sent, len(scan.content))
        out: list[CallDelta] = []
        for index, call in enumerate(scan.calls):
            first = index == len(self._sent)
            if first:
                if call.name is None:
                    break
                self._sent.append((self.parser.new_call_id(), 0))
            call_id, sent = self._sent[index]
            args = call.streamable_arguments()
            if final and call.complete and not call.arguments_done and not args and sent == 0:
                args = "{}"
            piece = args[sent:]
            self._sent[index] = (call_id, max(sent, len(args)))
            if first:  # OpenAI's order: the id and name open the call, then the arguments follow in pieces
                out.append(CallDelta(index, id=call_id, name=call.name, arguments=piece))
            elif piece:
                out.append(CallDelta(index, arguments=piece))
        return StreamDelta(content, tuple(out))


def mistral_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))
