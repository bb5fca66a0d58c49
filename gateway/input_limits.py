"""Limits on the size and shape of a request, checked after parsing and before any tokenizing or grammar work.

The body's size is the middleware's (gateway.http_guard, --max-body-bytes); `n`, `best_of`, logprobs, `max_tokens`,
`stop_token_ids` and `cache_salt` have bounds in the request models (gateway.protocol). This module bounds what a
model's field types cannot: the number of messages, a prompt's characters (before the tokenizer spends time on
them), logit_bias entries, stop sequences, the number and size of tools, and a structured-output schema's size and
nesting depth (a deep schema is a deep grammar). Each limit is a GatewayConfig field and flag (0: none) and each
breach an OpenAI 400 naming the field. The image limits are here too; gateway.images applies them as it fetches and
decodes a chat's images.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.errors import BadRequest

_D = GatewayConfig()


@dataclass(frozen=True)
class InputLimits:
    max_messages: int = _D.max_messages
    max_prompt_chars: int = _D.max_prompt_chars
    max_logit_bias: int = _D.max_logit_bias
    max_stop: int = _D.max_stop
    max_tools: int = _D.max_tools
    max_tool_bytes: int = _D.max_tool_bytes
    max_schema_bytes: int = _D.max_schema_bytes
    max_schema_depth: int = _D.max_schema_depth
    # images in chat messages (checked by gateway.images, which fetches and decodes them)
    max_images_per_request: int = _D.max_images_per_request
    max_image_bytes: int = _D.max_image_bytes
    max_image_pixels: int = _D.max_image_pixels
    allow_image_urls: bool = _D.allow_image_urls
    image_fetch_timeout: float = _D.image_fetch_timeout

    @classmethod
    def from_config(cls, config: GatewayConfig) -> InputLimits:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    # ------------------------------------------------------------------------------------ checks

    def check_chat(self, req) -> None:
        _count(len(req.messages), self.max_messages, "messages", "messages")
        chars = sum(_content_chars(m.content) for m in req.messages)
        _count(chars, self.max_prompt_chars, "messages", "characters of message content")
        self._check_common(req)
        if req.tools is not None:
            _count(len(req.tools), self.max_tools, "tools", "tools")
            for i, tool in enumerate(req.tools):
                size = len(tool.model_dump_json(exclude_none=True))
                _count(size, self.max_tool_bytes, f"tools[{i}]", "bytes of JSON in one tool")
                if tool.function.parameters is not None:
                    self._check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
        fmt = req.response_format
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            self._check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")

    def check_completion(self, req) -> None:
        prompt = req.prompt
        if isinstance(prompt, str):
            _count(len(prompt), self.max_prompt_chars, "prompt", "characters")
        elif prompt and isinstance(prompt[0], str):
            _count(sum(len(p) for p in prompt), self.max_prompt_chars, "prompt", "characters")
        if req.suffix is not None:
            _count(len(req.suffix), self.max_prompt_chars, "suffix", "characters")
        self._check_common(req)

    def check_texts(self, texts, param: str) -> None:
        """Characters of a text, or of a list of texts together (before any is tokenized); token ids pass."""
        if isinstance(texts, str):
            _count(len(texts), self.max_prompt_chars, param, "characters")
        elif texts and isinstance(texts[0], str):
            _count(sum(len(t) for t in texts), self.max_prompt_chars, param, "characters")

    def _check_common(self, req) -> None:
        if req.logit_bias is not None:
            _count(len(req.logit_bias), self.max_logit_bias, "logit_bias", "entries")
        if isinstance(req.stop, list):
            _count(len(req.stop), self.max_stop, "stop", "stop sequences")
        so = req.structured_outputs
        for param, schema in (("structured_outputs.json", so.json_ if so is not None else None),
                              ("guided_json", req.guided_json)):
            if schema is not None and not isinstance(schema, bool):
                self._check_schema(schema, param)
        for param, text in (("structured_outputs.regex", so.regex if so is not None else None),
                            ("structured_outputs.grammar", so.grammar if so is not None else None),
                            ("guided_regex", req.guided_regex), ("guided_grammar", req.guided_grammar)):
            if text is not None:
                _count(len(text), self.max_schema_bytes, param, "characters")
        for param, choice in (("structured_outputs.choice", so.choice if so is not None else None),
                              ("guided_choice", req.guided_choice)):
            if choice is not None:
                _count(sum(len(c) for c in choice), self.max_schema_bytes, param, "characters of choices")

    def _check_schema(self, schema: Any, param: str) -> None:
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        _count(len(text), self.max_schema_bytes, param, "bytes of schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return  # the structured-output compiler says what is wrong with it
        depth = _depth(schema, self.max_schema_depth + 1)
        if self.max_schema_depth and depth > self.max_schema_depth:
            raise BadRequest(f"{param}: the schema nests deeper than {self.max_schema_depth} levels "
                             "(--max-schema-depth)", param=param)


def _count(value: int, limit: int, param: str, what: str) -> None:
    if limit and value > limit:
        flag = {"messages": "--max-messages", "logit_bias": "--max-logit-bias", "stop": "--max-stop",
                "tools": "--max-tools"}.get(param)
        hint = f" ({flag})" if flag and what != "characters of message content" else ""
        raise BadRequest(f"{param}: {value} {what}, more than the limit of {limit}{hint}", param=param)


def _content_chars(content) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.text) for part in content if part.type == "text")


def _depth(value: Any, cap: int) -> int:
    """Nesting depth of JSON containers, counting no further than `cap` (iterative: no recursion limit)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest >= cap:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return deepest
