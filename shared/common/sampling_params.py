"""Per-request sampling parameters (the vLLM / OpenAI set), validated on construction.

A grammar travels with the request as source text (`StructuredOutputs`: a JSON schema, a regex, a list of
choices or an EBNF grammar, and its kind), never as compiled state: every node compiles it for itself (and
caches it), so a request can be prefilled on one node and decoded, or resumed, on another.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, replace

_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0


class StructuredOutputKind(str, enum.Enum):
    JSON = "json"  # source: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"  # any JSON object; source is empty
    REGEX = "regex"  # source: a regular expression
    CHOICE = "choice"  # source: a JSON array of the allowed strings
    GRAMMAR = "grammar"  # source: an EBNF (GBNF / Lark-like) grammar


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match. Equal records compile to the same grammar (the nodes' cache key)."""

    kind: StructuredOutputKind
    source: str = ""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", StructuredOutputKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in StructuredOutputKind)
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r}; one of {kinds}") from None
        if self.kind != StructuredOutputKind.JSON_OBJECT and not self.source:
            raise ValueError(f"structured_outputs: a {self.kind.value} constraint needs its source")
        if self.kind == StructuredOutputKind.CHOICE:
            choices = _json_or_none(self.source)
            _check(isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices),
                   "structured_outputs", "choice: must be a non-empty list of strings")
        if self.kind == StructuredOutputKind.JSON:
            schema = _json_or_none(self.source)
            _check(isinstance(schema, (dict, bool)), "structured_outputs", "json: the schema must be a JSON object")

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputs:
        return cls(StructuredOutputKind.CHOICE, json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> StructuredOutputs:
        # Key order kept: it is the order the grammar generates properties in.
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls(StructuredOutputKind.JSON, text)


class PoolingType(str, enum.Enum):
    """Which hidden states make a pooling request's vector (the final norm's output, as HF's last_hidden_state)."""

    LAST = "last"  # the last prompt token's: decoder embedders (Qwen3-Embedding, e5-mistral)
    MEAN = "mean"  # the mean over the prompt
    CLS = "cls"  # the first token's
    CLASSIFY = "classify"  # a sequence classifier's head on the last token: sigmoid of one output, else softmax


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request (an embedding): it ends once its prompt is computed, with a vector instead of tokens."""

    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True  # to unit length (after truncation to `dimensions`)
    dimensions: int | None = None  # keep only the first n dimensions (Matryoshka embeddings)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "pooling_type", PoolingType(self.pooling_type))
        except ValueError:
            kinds = ", ".join(k.value for k in PoolingType)
            raise ValueError(f"pooling_type: unknown {self.pooling_type!r}; one of {kinds}") from None
        _check(self.dimensions is None or (isinstance(self.dimensions, int) and self.dimensions >= 1), "dimensions",
               f"must be an integer >= 1, got {self.dimensions!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (so the prompt never starts from the cache)."""
        return self.pooling_type != PoolingType.LAST


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    priority: int = 0  # priority and sjf policies: lower value runs first
    structured_outputs: StructuredOutputs | None = None  # the output must match this grammar
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by token id
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob plus the top k
    # The last n prompt tokens are output this request generated before it moved to this engine (a migrated
    # request resumes): max_tokens, min_tokens, stop checks and the output penalties count them as output.
    num_resumed_tokens: int = 0
    pooling: PoolingParams | None = None  # an embedding request: no tokens, one vector once the prompt is computed

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias.items())))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs",
               f"must be between 0 and {_MAX_LOGPROBS}, got {self.logprobs}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative token ids")
        _check(all(t >= 0 and -_MAX_LOGIT_BIAS <= b <= _MAX_LOGIT_BIAS for t, b in self.logit_bias), "logit_bias",
               f"token ids must be non-negative and biases in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= _MAX_LOGPROBS, "prompt_logprobs",
               f"must be between 0 and {_MAX_LOGPROBS}, got {self.prompt_logprobs}")
        _check(isinstance(self.num_resumed_tokens, int) and self.num_resumed_tokens >= 0, "num_resumed_tokens",
               f"must be an integer >= 0, got {self.num_resumed_tokens!r}")
        _check(self.max_tokens is None or self.num_resumed_tokens < self.max_tokens, "num_resumed_tokens",
               f"must be < max_tokens ({self.max_tokens}): the request already ended, got {self.num_resumed_tokens}")
        _check(self.pooling is None or (self.n == 1 and self.prompt_logprobs is None and not self.num_resumed_tokens
                                        and self.structured_outputs is None), "pooling",
               "a pooling request samples nothing: no n > 1, prompt_logprobs, structured output or resumed output")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_child(self, index: int) -> SamplingParams:
        """The params of the index-th of n parallel samples: n=1, and a distinct seed stream."""
        seed = None if self.seed is None else child_seed(self.seed, index)
        return replace(self, n=1, seed=seed)


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search (vLLM's offline `LLM.beam_search` and the API's use_beam_search), deterministic: the
    beam_width best continuations by cumulative logprob, scored finished with HF's length penalty
    (sum of logprobs / generated_length ** length_penalty) and stopped by HF's early_stopping rule."""

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool | str = False  # True, False (HF's heuristic) or "never"
    temperature: float = 0.0  # only 0: the beams are the highest-scoring, never sampled

    def __post_init__(self) -> None:
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width",
               f"must be an integer >= 1, got {self.beam_width!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"must be >= 1, got {self.max_tokens!r}")
        _check(self.temperature == 0.0, "temperature", "beam search is deterministic: only 0 is supported")
        _check(self.early_stopping in (True, False, "never"), "early_stopping",
               f"must be true, false or 'never', got {self.early_stopping!r}")
        _check(math.isfinite(self.length_penalty), "length_penalty", f"must be finite, got {self.length_penalty}")


def child_seed(seed: int, index: int) -> int:
    # Child 0 keeps the seed so that n=1 and the first of n>1 sample alike.
    if index == 0:
        return seed
    return (seed * 1_000_003 + index * 0x9E3779B1) % (2**63)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
