"""The OpenAI wire schema (plus vLLM's extras): the only place in the gateway with pydantic models.

Requests ignore unknown fields, as OpenAI's own server does for forward compatibility. Bounds that protect
the wire (int64 seeds, int32 token ids, uint32 counts) live here; the meaning of each sampling value is
checked once, by kvrelay.common.sampling_params, so the HTTP API, the gRPC API and the engines agree.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_N = 128
MAX_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------------- errors


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ------------------------------------------------------------------------------------------- shared


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class PromptLogprob(_Response):
    """vLLM's shape: one entry per token id (the prompt's own token and the top k)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class _SamplingFields(_Request):
    """Fields chat and completions share; names and meanings follow OpenAI, then vLLM."""

    model: str | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = Field(default=None, max_length=256)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, max_length=256)
    priority: int = Field(default=0, ge=-(2**31), le=INT32_MAX)
    request_id: str | None = Field(default=None, max_length=128)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older names for structured_outputs
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # beam search (vLLM): best_of (or n) beams, the n best returned; deterministic
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


# --------------------------------------------------------------------------------------------- chat


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str = Field(min_length=1)  # a data: URL, or http(s) with --allow-image-urls
    detail: Literal["auto", "low", "high"] | None = None  # accepted; one resolution is all the encoder has


class ImageContentPart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM extra


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM extra, first chunk


# -------------------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids (int32), or lists of token ids"
    )
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None


class CompletionLogprobs(_Response):
    model_config = ConfigDict(extra="forbid")

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM extra


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


# ------------------------------------------------------------------------- tokenize, detokenize, version


class TokenizeRequest(_Request):
    """vLLM's two /tokenize bodies in one: a `prompt`, or chat `messages` (with the chat options)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's)
    return_token_strs: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


# ----------------------------------------------------------------------------------- models, health


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvrelay"
    root: str | None = None  # vLLM's: the base model's id, or a LoRA adapter's path
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (None for a base model)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter body; `base_model_name` picks the base model when several serve LoRA."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthNode(_Response):
    node_id: str
    role: str  # prefill, decode, or colocated (a decode node that computes its prompts itself)
    address: str
    source: str
    routable: bool
    reason: str | None = None
    breaker: Literal["closed", "open", "half_open"] = "closed"


class HealthResponse(_Response):
    status: Literal["ok", "degraded", "draining"]
    prefill_nodes: int  # routable, of each kind
    decode_nodes: int  # nodes that decode: colocated engines count here too
    colocated_nodes: int = 0
    nodes: list[HealthNode]
    reasons: list[str] = []  # why it is degraded: Redis unreachable, nodes out of rotation, no decode node
