"""The gateway's side of structured outputs and tools, without nodes: which constraint a request names,
the grammar a forced tool choice becomes, the conversation the chat template sees, the session hint in
routing, and the HTTP surface that needs no node (/tokenize, /detokenize, /version, X-Request-Id, CORS,
400s for bad schemas and tools)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from kvrelay.common.records import NodeLoad
from kvrelay.common.sampling_params import StructuredOutputKind
from kvrelay.gateway import structured, tools
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvrelay.gateway.router import Router
from kvrelay.gateway.tool_parsers import create_tool_parser
from tests.gateway.test_unit import FakeDiscovery, node, prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"$ref": "#/$defs/Zone"}}, "required": ["tz"],
    "$defs": {"Zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


# -- which constraint ---------------------------------------------------------------------------------------


def test_constraint_sources():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = structured.from_request(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}))
    assert spec.kind == StructuredOutputKind.JSON and json.loads(spec.source) == schema
    assert structured.from_request(chat(response_format={"type": "json_object"})).kind.value == "json_object"
    assert structured.from_request(chat(response_format={"type": "text"})) is None
    assert structured.from_request(chat(structured_outputs={"regex": "a+"})).source == "a+"
    assert json.loads(structured.from_request(chat(guided_choice=["x", "y"])).source) == ["x", "y"]
    assert structured.from_request(chat(guided_json=json.dumps(schema))).kind == StructuredOutputKind.JSON
    grammar = structured.from_request(CompletionRequest(prompt="p", guided_grammar='root ::= "a"'))
    assert grammar.kind == StructuredOutputKind.GRAMMAR


@pytest.mark.parametrize(("kw", "param", "match"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"structured_outputs": {"json": {"minLength": "three"}}}, "structured_outputs.json", "invalid JSON schema"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "give one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_*", "one output constraint"),
    ({"guided_choice": []}, "guided_*", "at least one"),
])
def test_bad_constraints_are_400s(kw, param, match):
    with pytest.raises(BadRequest, match=match) as e:
        structured.from_request(chat(**kw))
    assert e.value.param == param


# -- tools --------------------------------------------------------------------------------------------------


def test_tool_choice_plans():
    hermes = create_tool_parser("hermes")
    assert tools.plan(chat(), hermes).parser is None
    assert tools.plan(chat(tools=[WEATHER], tool_choice="none"), hermes).parser is None
    auto = tools.plan(chat(tools=[WEATHER]), hermes)
    assert auto.parser is hermes and auto.grammar is None and auto.finish_reason == "tool_calls"
    named = tools.plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}}), hermes)
    assert json.loads(named.grammar.source) == WEATHER["function"]["parameters"] and named.finish_reason is None
    required = tools.plan(chat(tools=[WEATHER, TIME], tool_choice="required"), hermes)
    assert required.finish_reason == "tool_calls" and required.grammar.kind == StructuredOutputKind.JSON


@pytest.mark.parametrize(("kw", "match"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "duplicate function name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "invalid JSON schema"),
])
def test_bad_tools_are_400s(kw, match):
    with pytest.raises(BadRequest, match=match):
        tools.plan(chat(**kw), None)


def test_required_grammar_accepts_exactly_valid_calls():
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(tools.plan(req, None).grammar.source)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {"tz": "UTC"}}], schema)  # $defs lifted to the root
    for bad in ([], [{"name": "get_weather", "parameters": {"days": 2}}],
                [{"name": "get_time", "parameters": {"tz": "PST"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tools.plan(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
                                   None).grammar.source)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "a"}}] * 2, single)


def test_tool_history_for_templates():
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12C"}]
    knowing = tools.template_messages(history, "{% for c in m.tool_calls %}{{ c.function.arguments|tojson }}",
                                      None)
    assert knowing[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    plain = tools.template_messages(history, "{{ message['content'] }}", create_tool_parser("hermes"))
    assert "tool_calls" not in plain[1]
    assert plain[1]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert plain[2] == history[2]


# -- the user as a session hint -------------------------------------------------------------------------------


def test_same_user_same_node_while_loads_are_comparable():
    nodes = [node(f"d{i}", "decode", NodeLoad(num_running=1)) for i in range(4)]
    router = Router(FakeDiscovery(nodes), make_policy("cache_aware"), None, local_prefill_threshold=10_000)
    homes = {}
    for user in ("alice", "bob", "carol", "dave", "erin", "frank"):
        picks = {asyncio.run(router.route(prompt(s, 40), user=user)).decode.node_id for s in range(5)}
        assert len(picks) == 1, f"{user} moved between {picks}"
        homes[user] = picks.pop()
    assert len(set(homes.values())) > 1  # users spread over the nodes
    # A clearly less loaded node still wins over the session's own.
    busy = [node(n.node_id, "decode", NodeLoad(num_running=1 if n.node_id != homes["alice"] else 40)) for n in nodes]
    router = Router(FakeDiscovery(busy), make_policy("cache_aware"), None, local_prefill_threshold=10_000)
    assert asyncio.run(router.route(prompt(1, 40), user="alice")).decode.node_id != homes["alice"]


# -- HTTP without nodes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from kvrelay.gateway.config import GatewayConfig
    from kvrelay.gateway.runtime import Gateway
    from kvrelay.gateway.server import build_app

    config = GatewayConfig(decode=("127.0.0.1:9",), allowed_origins=("https://app.example",), api_key="k",
                           health_interval=60)
    with TestClient(build_app(Gateway(config))) as client:
        yield client


AUTH = {"Authorization": "Bearer k"}


def test_tokenize_detokenize_version(http, default_tokenizer):
    r = http.post("/tokenize", headers=AUTH, json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == default_tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == default_tokenizer.hf.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] > 0
    msgs = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", headers=AUTH, json={"messages": msgs})
    assert r.json()["tokens"] == default_tokenizer.apply_chat_template(msgs)
    assert http.post("/detokenize", headers=AUTH, json={"tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    bad = http.post("/detokenize", headers=AUTH, json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.get("/version", headers=AUTH).json()["version"]
    assert http.post("/tokenize", headers=AUTH, json={"prompt": "x", "model": "other"}).status_code == 404
    r = http.post("/tokenize", headers=AUTH, json={"prompt": "x", "messages": msgs})
    assert r.json()["error"]["param"] == "prompt"
    for path in ("/tokenize", "/detokenize", "/version", "/metrics", "/openapi.json", "/docs"):  # keys exist: closed
        r = http.post(path, json={}) if "tokenize" in path else http.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert http.get("/health").status_code in (200, 503)  # the one open route


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
])
def test_bad_input_is_an_openai_400_with_the_request_id(http, body, param):
    r = http.post("/v1/chat/completions", headers={**AUTH, "X-Request-Id": "my-req-1"},
                  json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
    assert r.headers["x-request-id"] == "my-req-1"


def test_request_id_header_checks_and_cors(http):
    r = http.post("/v1/chat/completions", headers={**AUTH, "X-Request-Id": "x" * 200},
                  json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert http.get("/v1/models", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"  # a 401 too
    pre = http.options("/v1/chat/completions", headers={"Origin": "https://app.example",
                                                        "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    other = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    r = http.get("/v1/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
