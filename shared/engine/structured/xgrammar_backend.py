"""xgrammar (the grammar engine vLLM and SGLang default to): JSON schema, regex, choice and EBNF.

Chosen over llguidance by measurement on this code base's default vocabulary: it fills a next-token mask
several times faster, and compiles schemas as fast (docs/architecture.md, "Structured output", has the figures).
"""

from __future__ import annotations

import json
import logging
import threading

import torch

from kvrelay.common.sampling_params import StructuredOutputKind, StructuredOutputs
from kvrelay.engine.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher, GrammarVocab

logger = logging.getLogger(__name__)

# Compact JSON (", " and ": " only): a small model given free whitespace can spend its whole budget on it.
_ANY_WHITESPACE = False


class _Matcher(GrammarMatcher):
    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class _Compiled(CompiledGrammar):
    def __init__(self, xgr, compiled) -> None:
        self._xgr, self._compiled = xgr, compiled

    def matcher(self) -> GrammarMatcher:
        return _Matcher(self._xgr.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, vocab: GrammarVocab) -> None:
        import xgrammar as xgr

        from kvrelay.common.tokenizer import Tokenizer

        self._xgr = xgr
        hf = Tokenizer(vocab.tokenizer_path).hf
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.vocab_size,
                                                  stop_token_ids=list(vocab.stop_token_ids))
        # kvrelay keeps its own cache (by request spec, with in-flight compiles shared): none in xgrammar.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        try:
            with self._lock:
                compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: invalid {spec.kind.value}: {_first_line(e)}") from None
        return _Compiled(self._xgr, compiled)

    def _compile(self, spec: StructuredOutputs):
        c, kind = self._compiler, spec.kind
        if kind == StructuredOutputKind.JSON:
            return c.compile_json_schema(spec.source, any_whitespace=_ANY_WHITESPACE, strict_mode=True)
        if kind == StructuredOutputKind.JSON_OBJECT:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=_ANY_WHITESPACE, strict_mode=False)
        if kind == StructuredOutputKind.REGEX:
            return c.compile_regex(spec.source)
        if kind == StructuredOutputKind.CHOICE:
            return c.compile_grammar(choice_grammar(json.loads(spec.source)))
        return c.compile_grammar(spec.source)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"root ::= {alternatives}"


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]
