"""BERT-family encoders (BertModel, as sentence-transformers saves its embedding models): bidirectional attention,
learned absolute positions, post-LayerNorm layers, GELU. They embed; they never generate.

Every token attends to every token of its sequence, later ones too, so a sequence is computed whole in one step:
the engine gives an encoder no chunked prefill and no prefix cache (engine/core.py), and the attention here runs
on the step's own keys and values, one sequence at a time (the rows `meta.query_start_loc` delimits). The paged
KV cache the engine allocates stays unused: nothing decodes after the prompt.

Module names follow HF's BertModel, so the safetensors loader places every tensor by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, dtype=dtype)
        self.key = nn.Linear(hidden, hidden, dtype=dtype)
        self.value = nn.Linear(hidden, hidden, dtype=dtype)


class _Output(nn.Module):
    def __init__(self, fan_in: int, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(fan_in, hidden, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)  # noqa: N815 - HF's tensor names

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden, dtype)
        self.output = _Output(hidden, hidden, eps, dtype)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, size, dtype=dtype)


class _Layer(nn.Module):
    def __init__(self, hidden: int, size: int, heads: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.attention = _Attention(hidden, eps, dtype)
        self.intermediate = _Intermediate(hidden, size, dtype)
        self.output = _Output(size, hidden, eps, dtype)

    def forward(self, h: torch.Tensor, starts: list[int]) -> torch.Tensor:
        a = self.attention.self
        t, hidden = h.shape
        d = hidden // self.heads
        q, k, v = (proj(h).view(t, self.heads, d).transpose(0, 1) for proj in (a.query, a.key, a.value))
        ctx = torch.empty_like(h)
        for lo, hi in zip(starts, starts[1:], strict=False):  # each sequence sees all of itself, nothing else
            out = F.scaled_dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
            ctx[lo:hi] = out.transpose(0, 1).reshape(hi - lo, hidden)
        h = self.attention.output(ctx, h)
        return self.output(F.gelu(self.intermediate.dense(h)), h)


class _Embeddings(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype)  # noqa: N815


class _Encoder(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_Layer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                           c.layer_norm_eps, dtype) for _ in range(c.num_hidden_layers)])


class _Pooler(nn.Module):
    """BertModel's CLS pooler: loaded (checkpoints carry it) but unused, as sentence-transformers pools itself."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, dtype=dtype)


class BertModel(nn.Module):
    ENCODER = True  # bidirectional: whole sequences per step, no prefix cache, pooling requests only

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend | None, dtype: torch.dtype,
                 ops: Any = None) -> None:
        super().__init__()
        c = hf_config
        act = getattr(c, "hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"BertModel: unsupported hidden_act {act!r} (only 'gelu')")
        if getattr(c, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("BertModel: only absolute position embeddings")
        self.embeddings = _Embeddings(c, dtype)
        self.encoder = _Encoder(c, dtype)
        self.pooler = _Pooler(c.hidden_size, dtype)
        self.num_layers, self.num_heads = c.num_hidden_layers, c.num_attention_heads
        self.num_kv_heads, self.head_size = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        self.vocab_size, self.hidden_size = c.vocab_size, c.hidden_size
        self.max_position_embeddings = c.max_position_embeddings
        self.dtype = dtype
        self.arch = None  # no tied head (the loader asks)

    def after_materialize(self, device: torch.device) -> None:
        pass

    def after_load(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, on_layer_done: Callable[[int], None] | None = None,
                lora: Any = None) -> torch.Tensor:
        """The last layer's states of every row (each sequence whole in this step: see the module's doc)."""
        if any(s != q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True)):
            raise ValueError("BertModel: a sequence must be computed whole in one step (no chunks, no cache)")
        e = self.embeddings
        h = e.word_embeddings(input_ids) + e.position_embeddings(positions) + e.token_type_embeddings.weight[0]
        h = e.LayerNorm(h)
        starts = meta.query_start_loc.tolist()
        for i, layer in enumerate(self.encoder.layer):
            h = layer(h, starts)
            if on_layer_done is not None:
                on_layer_done(i)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("BertModel embeds; it has no vocabulary head to generate with")

    greedy_tokens = compute_logits

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("BertModel has no classification head")
