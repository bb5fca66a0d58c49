"""The grammar engine interface: compile a constraint once, then one matcher per request.

A matcher follows the tokens a request generates and says, before each of its samples, which tokens may
come next as a packed bitmask: int32 words, bit `t % 32` of word `t // 32` set when token `t` is allowed
(the layout xgrammar, llguidance and vLLM share, applied by kvrelay.engine.sampler).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvrelay.common.sampling_params import StructuredOutputs


@dataclass(frozen=True)
class GrammarVocab:
    """What a backend must know of the model's vocabulary."""

    tokenizer_path: str  # the model folder (HF tokenizer files)
    vocab_size: int  # the model's logits width (may exceed the tokenizer's, for padding)
    stop_token_ids: tuple[int, ...]  # a finished grammar allows exactly these


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32 [rows, words], on the CPU)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more is constrained."""


class CompiledGrammar(ABC):
    """A constraint compiled for one vocabulary; immutable and shared by every request that uses it."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(ABC):
    name = "base"

    @abstractmethod
    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (slow: run it off the step loop). ValueError naming structured_outputs when the schema,
        regex or grammar is invalid."""
