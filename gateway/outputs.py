"""Token ids -> text for one choice: incremental detokenizing, stop strings, logprob entries.

Stop strings are found in the text, not in the tokens: a stop string may span tokens, or end inside one.
The text is cut where the stop string starts (or ends, with include_stop_str_in_output) and the request
is over; the caller aborts it on the node. While streaming, the last len(longest stop) - 1 characters are
held back, so a client never receives a prefix of a stop string that the next token would have cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from kvrelay.common.records import TokenLogprobs
from kvrelay.common.tokenizer import IncrementalDetokenizer, Tokenizer
from kvrelay.common.wire import TokenChunk


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-k per token; None: no logprobs


@dataclass(frozen=True)
class LogprobEntry:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]  # (token_id, token, logprob), most likely first


@dataclass
class Delta:
    """What one choice produced since the last delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # of this delta's text within the choice's whole text


class TokenTexts:
    """Each token's own text, for logprobs (cached: the same ids recur across requests)."""

    def __init__(self, tokenizer: Tokenizer, size: int = 65536) -> None:
        self.get = lru_cache(maxsize=size)(lambda tid: tokenizer.decode([tid], skip_special_tokens=False))


class ChoiceOutput:
    def __init__(self, index: int, tokenizer: Tokenizer, texts: TokenTexts, prompt_ids: Sequence[int],
                 options: OutputOptions) -> None:
        self.index = index
        self.options = options
        self._texts = texts
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, options.skip_special_tokens)
        self._holdback = max((len(s) for s in options.stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # with the first chunk, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: TokenChunk) -> Delta:
        """Consume an engine chunk; returns the text now safe to send. Stops early at a stop string."""
        if self.finished:
            return Delta(self.index)
        delta = Delta(self.index, text_offset=self._sent)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        lps = chunk.logprobs if self.options.logprobs is not None else ()
        for i, token_id in enumerate(chunk.token_ids):
            self.token_ids.append(token_id)
            delta.token_ids.append(token_id)
            if i < len(lps):
                delta.logprobs.append(self._entry(lps[i]))
            if self._append(self._detok.feed(token_id)):
                break
        if chunk.finish_reason and not self.finished:
            self._append(self._detok.flush())
            if not self.finished:
                self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        delta.text = self._take()
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        return delta

    def abort(self, reason: str = "abort") -> Delta:
        """End the choice without the engine (node failure, shutdown)."""
        if self.finished:
            return Delta(self.index)
        self.finish_reason = reason
        return Delta(self.index, text=self._take(), finish_reason=reason, text_offset=self._sent)

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        start = len(self.text)
        self.text += piece
        for stop in self.options.stop:
            pos = self.text.find(stop, max(start - len(stop) + 1, 0))
            if pos >= 0:
                end = pos + len(stop) if self.options.include_stop_str_in_output else pos
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def _take(self) -> str:
        limit = len(self.text) if self.finished else len(self.text) - self._holdback
        if limit <= self._sent:
            return ""
        out, self._sent = self.text[self._sent : limit], limit
        return out

    def _entry(self, lp: TokenLogprobs) -> LogprobEntry:
        k = self.options.logprobs or 0
        top = tuple((t, self._texts.get(t), v) for t, v in lp.top[:k])
        return LogprobEntry(lp.token_id, self._texts.get(lp.token_id), lp.logprob, top)
