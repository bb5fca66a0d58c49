"""Datasets for `kvrelay bench serve`: seeded sessions of real English text.

The text is the stdlib-docstring corpus of `kvrelay.bench.workload` (offline, identical on every machine with the
same Python version). Lengths are approximate: in tokens when a tokenizer is given (a window of the corpus token
stream, decoded back to text), else in whitespace-separated words.

A session is one or more turns sent one after the other:
  random        one turn: a text window of a random input length, a random output length
  multi-tenant  one turn: the tenant's long shared system prompt (fixed per tenant) + a varying user question
  multi-turn    `turns` turns: each turn's messages hold the whole conversation so far, the assistant replies
                being the texts the server returned (see `Conversation`)
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrelay.bench.workload import corpus_tokens, iter_corpus_docs

DATASETS = ("random", "multi-tenant", "multi-turn")


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    seed: int = 0
    min_input: int = 32  # user message length, in the source's unit
    max_input: int = 512
    min_output: int = 16  # max_tokens of a request
    max_output: int = 128
    tenants: int = 4  # multi-tenant: number of distinct shared system prompts
    system_len: int = 1024  # multi-tenant: system prompt length
    turns: int = 4  # multi-turn: turns per conversation

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset: one of {', '.join(DATASETS)}, got {self.name!r}")
        if not 1 <= self.min_input <= self.max_input:
            raise ValueError(f"input lengths: need 1 <= min <= max, got {self.min_input}..{self.max_input}")
        if not 1 <= self.min_output <= self.max_output:
            raise ValueError(f"output lengths: need 1 <= min <= max, got {self.min_output}..{self.max_output}")
        for name in ("tenants", "system_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    index: int
    turns: tuple[Turn, ...]
    system: str | None = None
    tenant: int | None = None


# -- text ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _corpus_words() -> tuple[str, ...]:
    return tuple(word for doc in iter_corpus_docs() for word in doc.split())


class TextSource:
    """Corpus windows of an approximate length: tokens with a tokenizer (encode/decode), else words."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.unit = "words"
            self._stream: list = list(_corpus_words())
        else:
            self.unit = "tokens"
            self._stream = corpus_tokens(self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def window(self, rng: random.Random, length: int) -> str:
        """`length` units of corpus text starting at a seeded offset."""
        while len(self._stream) < 2 * length:
            self._stream = self._stream * 2
        start = rng.randint(0, len(self._stream) - length)
        piece = self._stream[start:start + length]
        return " ".join(piece) if self.tokenizer is None else self.tokenizer.decode(piece)

    def measure(self, text: str) -> int:
        """Length of `text` in the source's unit."""
        return len(text.split()) if self.tokenizer is None else len(self._encode(text))


def load_tokenizer(path: str):
    """The model folder's tokenizer (transformers is imported only when a folder is given)."""
    from kvrelay.common.tokenizer import Tokenizer

    return Tokenizer(path)


# -- sessions -----------------------------------------------------------------------------------------


def iter_sessions(spec: DatasetSpec, source: TextSource) -> Iterator[Session]:
    """Endless seeded sessions: the same spec and source give the same sessions in the same order."""
    rng = random.Random(spec.seed)
    systems = tenant_prompts(spec, source) if spec.name == "multi-tenant" else []
    for i in itertools.count():
        if spec.name == "random":
            yield Session(i, (_turn(rng, spec, source, ""),))
        elif spec.name == "multi-tenant":
            tenant = rng.randrange(spec.tenants)
            yield Session(i, (_turn(rng, spec, source, f"Question {i}: explain this passage.\n\n"),),
                          systems[tenant], tenant)
        else:
            yield Session(i, tuple(_turn(rng, spec, source, f"Turn {t + 1}: continue with this passage.\n\n")
                                   for t in range(spec.turns)))


def tenant_prompts(spec: DatasetSpec, source: TextSource) -> list[str]:
    rng = random.Random(f"tenants-{spec.seed}")
    return [f"You are the assistant of tenant {k}. Answer using this reference documentation.\n\n"
            + source.window(rng, spec.system_len) for k in range(spec.tenants)]


def _turn(rng: random.Random, spec: DatasetSpec, source: TextSource, header: str) -> Turn:
    input_len = rng.randint(spec.min_input, spec.max_input)
    max_tokens = rng.randint(spec.min_output, spec.max_output)
    return Turn(header + source.window(rng, input_len), max_tokens)


def iter_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Poisson send times (seconds after the start) at `rate` per second: 0, then seeded exponential gaps."""
    rng, t = random.Random(seed), 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    return list(itertools.islice(iter_arrivals(rate, seed), count))


# -- conversations ------------------------------------------------------------------------------------


@dataclass
class Conversation:
    """The growing message list of one session: user turns plus the replies the server returned."""

    session: Session
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.session.system is not None and not self.messages:
            self.messages.append({"role": "system", "content": self.session.system})

    def ask(self, turn: Turn) -> list[dict]:
        """Append the turn's user message; returns a copy of the messages to send."""
        self.messages.append({"role": "user", "content": turn.user})
        return [dict(m) for m in self.messages]

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def completion_prompt(messages: list[dict]) -> str:
    """The messages as one plain-text prompt, for the completions endpoint."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"])
        else:
            parts.append(f"{m['role'].capitalize()}: {m['content']}")
    return "\n\n".join(parts) + "\n\nAssistant:"
