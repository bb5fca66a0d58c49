"""POST /tokenize and /detokenize, GET /version: vLLM's shapes.

/tokenize takes a prompt (`prompt`, `add_special_tokens`) or a conversation (`messages`, rendered by the
chat template exactly as /v1/chat/completions renders it, tools included) and answers the token ids, their
count and max_model_len; /detokenize turns ids back into text.
"""

from __future__ import annotations

from kvrelay.gateway.core import GatewayCore
from kvrelay.gateway.errors import BadRequest
from kvrelay.gateway.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

VERSION = "0.1.0"


class TokenizeServing:
    def __init__(self, core: GatewayCore, render_chat) -> None:
        self.core = core
        self._render_chat = render_chat  # (TokenizeRequest) -> token ids, the chat endpoint's renderer

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give either prompt or messages", param="prompt")
        if req.messages is not None:
            ids = self._render_chat(req)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.core.tokenizer.encode(req.prompt, add_special_tokens=add)
        strs = list(self.core.tokenizer.hf.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.core.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        vocab = self.core.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=self.core.tokenizer.decode(req.tokens, skip_special_tokens=False))

    @staticmethod
    def version() -> VersionResponse:
        return VersionResponse(version=VERSION)

