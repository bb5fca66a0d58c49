"""Grammar-constrained decoding (structured outputs): backends by name, and the compile cache.

    compiler = create_grammar_compiler(config.structured, vocab)
    future = compiler.submit(StructuredOutputs.json_schema({...}))   # compiled off the step loop
    matcher = compiler.get(spec).matcher()                           # one per request
"""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.engine.config import StructuredOutputsConfig
from kvrelay.engine.structured.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    GrammarVocab,
    bitmask_words,
)
from kvrelay.engine.structured.compiler import GrammarCompiler

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarCompiler", "GrammarMatcher", "GrammarVocab",
           "bitmask_words", "create_grammar_backend", "create_grammar_compiler", "BACKENDS"]


def _xgrammar(vocab: GrammarVocab) -> GrammarBackend:
    from kvrelay.engine.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(vocab)


BACKENDS: dict[str, Callable[[GrammarVocab], GrammarBackend]] = {"xgrammar": _xgrammar}


def create_grammar_backend(name: str, vocab: GrammarVocab) -> GrammarBackend:
    try:
        make = BACKENDS[name]
    except KeyError:
        raise ValueError(f"structured_outputs_backend: unknown backend {name!r}; choose one of "
                         f"{sorted(BACKENDS)}") from None
    return make(vocab)


def create_grammar_compiler(config: StructuredOutputsConfig, vocab: Callable[[], GrammarVocab]) -> GrammarCompiler:
    """`vocab` is asked on first use (the backend is built then, on the compile pool)."""
    name = config.structured_outputs_backend
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend: unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    return GrammarCompiler(config, lambda: create_grammar_backend(name, vocab()))
