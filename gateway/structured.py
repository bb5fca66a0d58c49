"""What the output must match, from any of the ways clients say it: OpenAI's response_format
(json_object, json_schema), vLLM's structured_outputs {json, regex, choice, grammar, json_object}, and its
older guided_json / guided_regex / guided_choice / guided_grammar.

The result is a StructuredOutputs record (the grammar as source text) that travels to the nodes inside the
sampling params; they compile it. A JSON schema is checked here against its metaschema, so a malformed one
is a 400 naming the field before any node is involved; regexes and grammars are checked by the nodes'
grammar engine (also a 400: INVALID_ARGUMENT comes back as bad input).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from kvrelay.common.sampling_params import StructuredOutputKind, StructuredOutputs
from kvrelay.gateway.errors import BadRequest

Kind = StructuredOutputKind


def from_request(req) -> StructuredOutputs | None:
    """The request's one output constraint, or None; 400 when it names several or a bad one."""
    found: list[tuple[str, StructuredOutputs]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputs(Kind.JSON_OBJECT)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise BadRequest("response_format: json_schema needs json_schema.schema", param="response_format")
        found.append(("response_format", json_spec(rf.json_schema.schema_, "response_format.json_schema.schema")))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found += _vllm(so.json_, so.regex, so.choice, so.grammar, bool(so.json_object), "structured_outputs")
    found += _vllm(getattr(req, "guided_json", None), getattr(req, "guided_regex", None),
                   getattr(req, "guided_choice", None), getattr(req, "guided_grammar", None), False, "guided_*")
    if len(found) > 1:
        names = ", ".join(sorted({name for name, _ in found}))
        raise BadRequest(f"give one output constraint, not several ({names})", param=found[1][0])
    return found[0][1] if found else None


def _vllm(schema, regex, choice, grammar, json_object: bool, param: str) -> list[tuple[str, StructuredOutputs]]:
    out = []
    if schema is not None:
        out.append((param, json_spec(schema, f"{param}.json" if param == "structured_outputs" else "guided_json")))
    if regex is not None:
        out.append((param, _spec(Kind.REGEX, regex, param)))
    if choice is not None:
        if not choice:
            raise BadRequest(f"{param}: choice must list at least one string", param=param)
        out.append((param, StructuredOutputs.choice(choice)))
    if grammar is not None:
        out.append((param, _spec(Kind.GRAMMAR, grammar, param)))
    if json_object:
        out.append((param, StructuredOutputs(Kind.JSON_OBJECT)))
    if len(out) > 1:
        raise BadRequest(f"{param}: give one of json, regex, choice, grammar, json_object", param=param)
    return out


def json_spec(schema: dict[str, Any] | bool | str, param: str) -> StructuredOutputs:
    """A JSON schema (object or JSON text), checked against its metaschema; 400 naming `param` if invalid."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadRequest(f"{param}: not valid JSON: {e}", param=param) from None
    check_schema(schema, param)
    return StructuredOutputs.json_schema(schema)


def check_schema(schema, param: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise BadRequest(f"{param}: a JSON schema must be an object", param=param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise BadRequest(f"{param}: invalid JSON schema at {where}: {e.message}", param=param) from None


def _spec(kind: Kind, source: str, param: str) -> StructuredOutputs:
    if not source:
        raise BadRequest(f"{param}: the {kind.value} must not be empty", param=param)
    return StructuredOutputs(kind, source)
