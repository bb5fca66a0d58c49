"""Thin wrapper over a model folder's HF tokenizer, plus streaming detokenization.

Shared by the engine and the gateway so both tokenize and detokenize identically.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import AutoTokenizer

logger = logging.getLogger(__name__)

# Context tokens decoded before the read offset: enough for tokenizers (SentencePiece) that render a
# token differently at the start of a string, e.g. dropping the leading space of "▁Paris".
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Encode, chat-template and decode for one model folder."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.hf = AutoTokenizer.from_pretrained(str(self.path))
        # The Rust tokenizer's decode skips transformers' per-call overhead and its space clean-up,
        # which would otherwise make full and incremental decodes disagree (and mangle code).
        self._backend = getattr(self.hf, "backend_tokenizer", None)
        self.stop_token_ids = self._load_stop_token_ids()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens applies the model's own rule (Llama 2 adds BOS, SmolLM2 nothing)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """A pair as one sequence, with the separators the tokenizer's template puts between them (what a
        cross-encoder was trained on, and what transformers gives for tokenizer(text, pair))."""
        return list(self.hf(text, pair)["input_ids"])

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template rendered as text (useful for logs and for the completions API)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"tokenizer at {self.path} has no chat template; use plain completions")
        return self.hf.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """Prompt token ids for a chat, ending with the assistant generation prompt."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        # Templates write BOS themselves when the model wants it; adding special tokens would double it.
        return self.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce, added ones included; model logits may be wider (padding)."""
        return len(self.hf)

    def _load_stop_token_ids(self) -> frozenset[int]:
        # generation_config.json may list end tokens beyond the tokenizer's eos (e.g. Llama 3's <|eot_id|>).
        ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        gen_path = self.path / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(int(i) for i in ids)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting multi-byte characters.

    Keeps two offsets into the ids: text up to `read_offset` has been emitted; decoding restarts
    at `prefix_offset` so the new text is measured against the same context. A delta is held back
    while the decoded text ends in U+FFFD, i.e. while a character's bytes are still incomplete.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids]
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []

    def feed(self, token_id: int) -> str:
        """Add one generated token; returns the newly completed text (often '', never a partial char)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (incomplete bytes render as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        """Generated ids fed so far (prompt excluded)."""
        return self._ids[self._num_prompt :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
