"""Per-request sampling parameters (the vLLM / OpenAI set), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_MAX_LOGPROBS = 20


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
    priority: int = 0  # priority policy: lower value runs first
    # The last n prompt tokens are output this request generated before it moved to this engine (a migrated
    # request resumes): max_tokens, min_tokens, stop checks and the output penalties count them as output.
    num_resumed_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
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
        _check(isinstance(self.num_resumed_tokens, int) and self.num_resumed_tokens >= 0, "num_resumed_tokens",
               f"must be an integer >= 0, got {self.num_resumed_tokens!r}")
        _check(self.max_tokens is None or self.num_resumed_tokens < self.max_tokens, "num_resumed_tokens",
               f"must be < max_tokens ({self.max_tokens}): the request already ended, got {self.num_resumed_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_child(self, index: int) -> SamplingParams:
        """The params of the index-th of n parallel samples: n=1, and a distinct seed stream."""
        seed = None if self.seed is None else child_seed(self.seed, index)
        return replace(self, n=1, seed=seed)


def child_seed(seed: int, index: int) -> int:
    # Child 0 keeps the seed so that n=1 and the first of n>1 sample alike.
    if index == 0:
        return seed
    return (seed * 1_000_003 + index * 0x9E3779B1) % (2**63)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
