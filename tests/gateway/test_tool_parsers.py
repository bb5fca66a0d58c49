"""Tool parsers on recorded outputs in each model family's format, whole and streamed: streamed in any
split, the deltas must rebuild exactly what the whole-text parse finds (content, names, arguments), the
name must come before any argument, and the indexes must follow the calls."""

from __future__ import annotations

import json
import random

import pytest

from kvrelay.gateway.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser, create_tool_parser

# Outputs as the models write them (Qwen2.5-7B-Instruct for hermes, Llama-3.1-8B-Instruct for llama3_json,
# Mistral-7B-Instruct-v0.3 and a v11 tokenizer for mistral).
RECORDED = {
    "hermes": [
        ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
         '"unit": "fahrenheit"}}\n</tool_call>',
         None, [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
        ('I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo \\"JP\\"", '
         '"days": [1, 2]}}\n</tool_call>',
         "I will check both cities.\n",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": 'Tokyo "JP"', "days": [1, 2]})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        ('<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>', None, [("list_files", {})]),
    ],
    "llama3_json": [
        ('{"name": "get_current_conditions", "parameters": {"location": "Boston, MA", "unit": "celsius"}}',
         None, [("get_current_conditions", {"location": "Boston, MA", "unit": "celsius"})]),
        ('<|python_tag|>{"name": "search", "parameters": {"q": "kv cache; paged"}}; '
         '{"name": "search", "parameters": {"q": "vllm"}}',
         None, [("search", {"q": "kv cache; paged"}), ("search", {"q": "vllm"})]),
        ("Hello! How can I help you today?", "Hello! How can I help you today?", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: content
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
         '"format": "celsius"}}]',
         None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
        ('Let me look.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [2]}}]',
         "Let me look.", [("a", {"x": 1}), ("b", {"y": [2]})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
         None, [("get_weather", {"city": "Lyon"}), ("get_time", {"tz": "CET"})]),
        ("No tools needed.", "No tools needed.", []),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
def test_parse_recorded(parser_name, text, content, calls):
    parsed = create_tool_parser(parser_name).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == content
    assert len({c.id for c in parsed.calls}) == len(calls)


def _stream(parser: ToolParser, pieces: list[str]):
    stream = parser.stream()
    deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.calls:
            if c.index not in calls:
                assert c.id and c.name, "a call must open with its id and name"
                assert c.index == len(calls), "indexes follow the calls"
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": c.arguments}
            else:
                assert c.id is None and c.name is None
                calls[c.index]["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)], deltas


def _splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        pieces.append(text[i : i + n])
        i += n
    return pieces + [""]


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_rebuilds_the_parse(parser_name, text, content, calls, seed):
    parser = create_tool_parser(parser_name)
    whole = parser.parse(text)
    got_content, got_calls, deltas = _stream(parser, _splits(text, seed))
    assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in whole.calls]
    if calls:
        assert got_content.strip() == (content or "").strip()
        if max(len(c["arguments"]) for c in got_calls) > 8:  # arguments arrive in pieces, not at the end
            assert sum(1 for d in deltas for c in d.calls if c.arguments) >= 2
    else:
        assert got_content == text


def test_markers_are_held_back_until_they_resolve():
    stream = create_tool_parser("hermes").stream()
    assert stream.feed("Sure <tool").content == "Sure "
    assert stream.feed("box> is a word").content == "<toolbox> is a word"


def test_character_by_character_arguments_are_a_prefix_at_every_step():
    text = RECORDED["hermes"][1][0]
    stream = create_tool_parser("hermes").stream()
    args = {}
    for i, ch in enumerate(text):
        for c in stream.feed(ch, final=i == len(text) - 1).calls:
            args[c.index] = args.get(c.index, "") + c.arguments
    assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}, {"city": 'Tokyo "JP"', "days": [1, 2]}]


def test_double_encoded_arguments_are_sent_decoded_once_complete():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    parser = create_tool_parser("hermes")
    assert parser.parse(text).calls[0].arguments == '{"a": 1}'
    _, calls, _ = _stream(parser, _splits(text, 3))
    assert calls[0]["arguments"] == '{"a": 1}'


def test_forced_choice_parsers():
    required = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    parsed = RequiredToolParser().parse(required)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    _, calls, _ = _stream(RequiredToolParser(), _splits(required, 5))
    assert [c["arguments"] for c in calls] == ['{"city": "Oslo"}', "{}"]
    named = '{"city": "Oslo", "days": 3}'
    assert NamedToolParser("get_weather").parse(named).calls[0].arguments == named
    _, calls, deltas = _stream(NamedToolParser("get_weather"), _splits(named, 6))
    assert calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": named}]


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'nope'"):
        create_tool_parser("nope")


def test_call_ids():
    assert create_tool_parser("hermes").new_call_id().startswith("call_")
    mid = create_tool_parser("mistral").new_call_id()
    assert len(mid) == 9 and mid.isalnum()
