"""Reading tool calls out of text that may still be growing: where a JSON value ends (or that it has not
ended yet), and a call object's name and raw arguments text.

The arguments are kept as the model wrote them (a substring of the output), so what has been streamed is
always a prefix of what comes next, and the concatenated pieces are the final arguments exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = re.compile(r"\s*")
_LITERAL_END = re.compile(r"[^,\]}\s]*")
ARGUMENT_KEYS = ("arguments", "parameters")


class NotACall(ValueError):
    """The text is not a tool call of the expected shape."""


@dataclass(frozen=True)
class PartialCall:
    """What the text shows of one call so far."""

    name: str | None
    arguments: str  # raw JSON text written so far ("" before it starts)
    arguments_done: bool
    complete: bool  # the call's object is closed

    def streamable_arguments(self) -> str:
        """The part safe to send: raw object text as it grows; a double-encoded string only once complete."""
        if self.arguments.startswith('"'):
            return _decoded_string(self.arguments) if self.arguments_done else ""
        return self.arguments

    def final_arguments(self) -> str:
        if not self.arguments_done:
            return self.arguments or "{}"
        return _decoded_string(self.arguments) if self.arguments.startswith('"') else self.arguments


def _decoded_string(text: str) -> str:
    value = json.loads(text)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def string_end(text: str, pos: int) -> int | None:
    """End (exclusive) of the string literal opening at pos, or None when the text ends inside it."""
    i, n = pos + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int, final: bool = False) -> int | None:
    """End (exclusive) of the JSON value starting at pos, or None when the text ends before it does."""
    c = text[pos]
    if c == '"':
        return string_end(text, pos)
    if c in "{[":
        depth, i, n = 0, pos, len(text)
        while i < n:
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    end = _LITERAL_END.match(text, pos).end()
    return end if end < len(text) or final else None  # a number may still be growing


def scan_call(text: str, pos: int, final: bool = False,
              arg_keys: tuple[str, ...] = ARGUMENT_KEYS) -> tuple[PartialCall, int | None]:
    """The call object {"name": ..., "arguments": ...} at pos (after whitespace): what is known of it, and
    its end (None while it is open). NotACall when the text cannot be such an object."""
    name: str | None = None
    args, args_done = "", False

    def partial() -> tuple[PartialCall, None]:
        return PartialCall(name, args, args_done, False), None

    i = skip_ws(text, pos)
    if i >= len(text):
        return partial()
    if text[i] != "{":
        raise NotACall(f"expected an object, got {text[i:i + 20]!r}")
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return partial()
        if text[i] == "}":
            return PartialCall(name, args, args_done, True), i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            raise NotACall(f"expected a key, got {text[i:i + 20]!r}")
        key_end = string_end(text, i)
        if key_end is None:
            return partial()
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return partial()
        if text[i] != ":":
            raise NotACall("expected ':' after a key")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return partial()
        end = value_end(text, i, final)
        if key == "name":
            if end is None:
                return partial()
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise NotACall("the name is not a string")
        elif key in arg_keys:
            args = text[i:end] if end is not None else text[i:]
            if end is None:
                return partial()
            args_done = True
        elif end is None:
            return partial()
        i = end


def scan_call_list(text: str, pos: int, final: bool = False,
                   arg_keys: tuple[str, ...] = ARGUMENT_KEYS) -> list[PartialCall]:
    """Call objects in a JSON array at pos ([{...}, {...}]); the last may be partial."""
    i = skip_ws(text, pos)
    if i >= len(text):
        return []
    if text[i] != "[":
        raise NotACall("expected a list of calls")
    calls: list[PartialCall] = []
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text) or text[i] == "]":
            return calls
        if text[i] == ",":
            i += 1
            continue
        call, end = scan_call(text, i, final, arg_keys)
        calls.append(call)
        if end is None:
            return calls
        i = end


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
