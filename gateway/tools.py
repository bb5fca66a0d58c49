"""Tools in chat requests: what tool_choice asks for, the grammar that enforces a forced choice, and the
conversation as the chat template should see it.

- "none": tools reach the template, the output is plain content.
- "auto" (the default with tools): the model decides; its output is parsed with --tool-call-parser.
- "required": the output is a JSON list of {"name", "parameters"} objects, each valid for its function's
  parameters schema by construction (a grammar); finish_reason "tool_calls".
- a named function: the output is that function's arguments, valid for its schema by construction;
  finish_reason "stop", as OpenAI answers a forced function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvrelay.common.sampling_params import StructuredOutputs
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.protocol import ChatCompletionRequest, NamedToolChoice
from kvrelay.gateway.structured import check_schema
from kvrelay.gateway.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # None: the output is content only
    grammar: StructuredOutputs | None = None  # forced choices
    finish_reason: str | None = None  # replaces "stop" when calls were made
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.grammar is not None


def plan(req: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None)
    by_name = {}
    for i, tool in enumerate(tools):
        if tool.function.name in by_name:
            raise BadRequest(f"tools: duplicate function name {tool.function.name!r}", param=f"tools.{i}")
        check_schema(parameters(tool), f"tools.{i}.function.parameters")
        by_name[tool.function.name] = tool
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(None)
    if isinstance(choice, NamedToolChoice):
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise BadRequest(f"tool_choice: function {choice.function.name!r} is not among the tools "
                             f"({', '.join(by_name)})", param="tool_choice")
        return ToolPlan(NamedToolParser(tool.function.name), StructuredOutputs.json_schema(parameters(tool)),
                        None, parallel)
    if choice == "required":
        grammar = StructuredOutputs.json_schema(required_schema(list(by_name.values()), parallel))
        return ToolPlan(RequiredToolParser(), grammar, "tool_calls", parallel)
    return ToolPlan(auto_parser, None, "tool_calls", parallel)


def parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else dict(_EMPTY_PARAMETERS)


def required_schema(tools: list, parallel: bool) -> dict:
    """One or more calls of any of the tools, each {"name": <its name>, "parameters": <its schema>}.
    Each function's $defs are lifted to the root, where their "#/$defs/..." references point."""
    defs: dict = {}
    variants = []
    for tool in tools:
        params = dict(parameters(tool))
        defs.update(params.pop("$defs", None) or {})
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict], template: str, parser: ToolParser | None) -> list[dict]:
    """Messages for the chat template: tool call arguments as objects (templates render them with tojson);
    for a template that knows nothing of tool calls, the calls written into the assistant's content in the
    parser's format, so the model sees what it called."""
    knows_calls = "tool_calls" in template
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] != "assistant" or not calls:
            out.append(m)
            continue
        m = dict(m)
        if knows_calls:
            m["tool_calls"] = [_with_object_arguments(c) for c in calls]
        else:
            writer = parser or RequiredToolParser()
            written = "\n".join(writer.format_call(_fn(c).get("name", ""), _arguments_text(c)) for c in calls)
            m["content"] = "\n".join(p for p in (m.get("content") or "", written) if p)
            del m["tool_calls"]
        out.append(m)
    return out


def tools_instruction(tools: list, parser: ToolParser) -> str:
    """A system message offering the tools, for templates that do not render `tools` themselves."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    example = parser.format_call("<function-name>", '{"<argument>": "<value>"}')
    return ("You can call functions to help with the request. The functions, as JSON:\n"
            f"{listed}\n\nTo call one, reply with exactly:\n{example}")


def _fn(call: dict) -> dict:
    fn = call.get("function")
    return fn if isinstance(fn, dict) else {}


def _arguments_text(call: dict) -> str:
    args = _fn(call).get("arguments", "{}")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _with_object_arguments(call: dict) -> dict:
    fn = _fn(call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise BadRequest("messages: a tool call's arguments are not valid JSON", param="messages") from None
        call = {**call, "function": {**fn, "arguments": args}}
    return call
