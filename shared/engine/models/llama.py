"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) running over a paged KV cache.

One implementation with per-architecture switches: Qwen2 adds q/k/v biases, Qwen3 normalises q and k per
head before rotary. q/k/v and gate/up are fused into single matmuls; the loader slices the HF tensors into
them. The batch is flat (no padding): T tokens of many requests, positions absolute per request.

LoRA: with adapters on (kvrelay.engine.lora), each projection holds its adapters' slots (`lora`), and a forward
given the step's per-row slots (`LoRABatch`) adds each row's adapter update after the base matmul.

Quantized weights: a projection given `use_blocks` computes on a GGUF file's blocks (`--quantization gguf`,
models/gguf_blocks.py; the embedding becomes a BlockEmbedding) or an AWQ/GPTQ/FP8 checkpoint's weights
(models/quant_weights.py) instead of a dense weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kvrelay.engine.attention.base import AttentionBackend, AttentionMetadata
from kvrelay.engine.lora.layers import LoRABatch, LoRAProjection
from kvrelay.engine.models.ops import LayerOps

from . import cpu_linear
from .gguf_stack import GGUFLayerStack
from .rotary import RotaryEmbedding, rope_parameters


class QuantizedWeight(Protocol):
    """A [rows, cols] weight held quantized that computes x @ W^T + bias itself."""

    @property
    def rows(self) -> int: ...

    @property
    def cols(self) -> int: ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class ArchConfig:
    """What the layers need from a HF config, resolved once (defaults and per-architecture quirks)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    num_labels: int  # a sequence classifier's outputs (its `score` head); 0: a language model (`lm_head`)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold the residual add into the norm: residual += x, return (norm(residual), residual); without a
        residual (the first layer), x is the residual."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-optional linear layer whose parameters are created uninitialised in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # the weight in the CPU kernels' layouts (after_load)
        self.lora: LoRAProjection | None = None  # its LoRA adapters' slots (kvrelay.engine.lora), when on
        # The weight kept quantized: a GGUF file's blocks (--quantization gguf), or an AWQ/GPTQ/FP8 checkpoint's
        # tiles (models/quant_weights.py); anything with rows, cols and linear(x, bias).
        self.blocks: QuantizedWeight | None = None

    def use_blocks(self, blocks: QuantizedWeight) -> None:
        """Compute on `blocks` from now on; `weight` keeps its shape and dtype but holds no values."""
        if (blocks.rows, blocks.cols) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight of {blocks.rows} x {blocks.cols} for a {tuple(self.weight.shape)} "
                             "projection")
        self.blocks = blocks
        self.weight = nn.Parameter(torch.zeros((), dtype=self.weight.dtype).expand(blocks.rows, blocks.cols),
                                   requires_grad=False)

    def after_load(self, arena: cpu_linear.PackArena | None = None) -> None:
        if self.blocks is None:
            self.packed = cpu_linear.pack(self.weight, arena=arena)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.blocks is not None:
            y = self.blocks.linear(x, self.bias)
        else:
            y = cpu_linear.linear(x, self.weight, self.bias, self.packed)
        if lora is not None and self.lora is not None:
            self.lora.add(y, x, lora)
        return y


class LMHead(Linear):
    """The vocabulary projection. Up to its packed weight's `small_rows` rows it runs whole in the small GEMM,
    whose greedy variant keeps a running argmax per row (no logits written at all). More rows go one fixed tile of the
    vocabulary at a time: the logits of a batch over a 49k vocabulary are tens of MB, tile by tile they stay in
    cache. Full logits and the greedy argmax come from the same kernel at a given row count, so they agree
    exactly. On a GPU: one GEMM over the whole vocabulary (no tiles: each would be a kernel launch).
    """

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, vocab_size, False, dtype)
        self.tiles: list[tuple[int, torch.Tensor, cpu_linear.PackedWeight | None]] = []  # (first token, weight, packed)

    def after_load(self, arena: cpu_linear.PackArena | None = None, tile: int = 2048) -> None:
        if self.blocks is not None or self.weight.device.type != "cpu":  # a GPU: one GEMM over the whole vocabulary
            return
        # Large enough for huge pages of its own: no arena.
        self.packed = cpu_linear.pack(self.weight, onednn=False)  # whole, for the small GEMM only
        slices = [(start, self.weight[start : start + tile]) for start in range(0, self.weight.shape[0], tile)]
        self.tiles = [(start, weight, cpu_linear.pack(weight)) for start, weight in slices]

    def _small(self, hidden: torch.Tensor) -> bool:
        return (self.packed is not None and self.packed.small is not None and hidden.dim() == 2
                and hidden.shape[0] <= self.packed.small_rows)

    def _tile_logits(self, hidden: torch.Tensor):
        for start, weight, packed in self.tiles or [(0, self.weight, None)]:
            yield start, cpu_linear.linear(hidden, weight, None, packed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return self.blocks.linear(hidden)
        if self._small(hidden):
            return cpu_linear.linear(hidden, self.weight, None, self.packed)
        return torch.cat([logits for _, logits in self._tile_logits(hidden)], dim=-1)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax over the vocabulary of forward(hidden); ties resolve to the lowest token id, as in
        torch.argmax."""
        if self.blocks is not None:
            # max's indices, not argmax: the same first index of the largest, and on bf16 logits 5x faster (32 rows
            # of SmolLM2's vocabulary: 0.46 against 2.57 ms, 3% of a served concurrency-32 run).
            return self.blocks.linear(hidden).max(dim=-1).indices
        if self._small(hidden):
            return cpu_linear.greedy(hidden, self.packed)
        best_val = best_idx = None
        for start, logits in self._tile_logits(hidden):
            val, idx = logits.max(dim=-1)
            if best_val is None:
                best_val, best_idx = val, idx
            else:
                better = val > best_val  # strictly: an equal later value loses to the earlier token
                best_val = torch.where(better, val, best_val)
                best_idx = torch.where(better, idx + start, best_idx)
        return best_idx


class FusedLinear(Linear):
    """Several HF projections stacked along the output dim; `shards` maps each HF name to its row range."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(shards.values()), bias, dtype)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shards[name] = (start, size)
            start += size


class GateUpLinear(FusedLinear):
    """gate_proj and up_proj stacked; `act(h)` is SiLU(gate) * up, in one kernel where the CPU has one (AMX)."""

    def __init__(self, in_features: int, size: int, bias: bool, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__(in_features, {"gate_proj": size, "up_proj": size}, bias, dtype)
        self.ops = ops
        self.silu_packed: torch.Tensor | None = None

    def after_load(self, arena: cpu_linear.PackArena | None = None) -> None:
        if self.blocks is not None:
            return
        self.silu_packed = cpu_linear.pack_silu_mul(self.weight, arena) if self.bias is None else None
        if self.silu_packed is None:  # the plain layouts only where act() uses them
            super().after_load(arena)

    def act(self, h: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.silu_packed is not None and (lora is None or self.lora is None):
            return cpu_linear.silu_mul_linear(h, self.silu_packed)  # a bf16 CPU weight: bf16 rows on the CPU too
        return self.ops.silu_mul(self(h, lora))


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(
            cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, cfg.qkv_bias, dtype
        )
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        window = cfg.sliding_windows[layer]
        # Only windowed layers pass the extra argument, so plain AttentionBackends work for the rest.
        self.backend_kwargs = {"sliding_window": window} if window is not None else {}

    def forward(
        self,
        h: torch.Tensor,
        rope: object,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        t = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(h, lora)
        qk = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, :nh] = self.q_norm(qk[:, :nh])
            qk[:, nh:] = self.k_norm(qk[:, nh:])
        self.ops.rope_(qk, rope)  # q and k rotated together, in place
        v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
        out = self.backend.forward(qk[:, :nh], qk[:, nh:], v, kv_cache, meta, self.scale, **self.backend_kwargs)
        return self.o_proj(out.reshape(t, nh * d), lora)


class MLP(nn.Module):
    """gate_up -> SiLU * up -> down. Many rows go through in chunks, so that the 2 x intermediate-wide
    activations stay in cache between the ops (fp32, 2048 rows of SmolLM2: 25 MB; in chunks of 1024 the
    MLP ran 10% faster; bf16 at 12.6 MB gained nothing)."""

    CHUNK_BYTES = 16 * 1024**2

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, size, cfg.mlp_bias, dtype, ops)
        self.down_proj = Linear(size, cfg.hidden_size, cfg.mlp_bias, dtype)
        self.size = size

    def forward(self, h: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        rows = h.shape[0]
        chunks = -(-rows * 2 * self.size * h.element_size() // self.CHUNK_BYTES)
        if chunks <= 1:
            return self.down_proj(self.gate_up_proj.act(h, lora), lora)
        step = -(-rows // chunks)
        return torch.cat([self._rows(h, i, i + step, lora) for i in range(0, rows, step)])

    def _rows(self, h: torch.Tensor, start: int, stop: int, lora: LoRABatch | None) -> torch.Tensor:
        part = None if lora is None else lora.rows(start, stop)
        return self.down_proj(self.gate_up_proj.act(h[start:stop], part), part)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, backend: AttentionBackend, dtype: torch.dtype,
                 ops: LayerOps) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, backend, dtype, ops)
        self.mlp = MLP(cfg, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: object,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_forward(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype, ops: LayerOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, backend, dtype, ops) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class LlamaForCausalLM(nn.Module):
    """Llama 1/2/3 (incl. llama3 rope scaling, tied embeddings); the base of the other variants."""

    QKV_BIAS: bool | None = None  # None: config.attention_bias
    O_BIAS: bool | None = None
    QK_NORM = False
    CLASSIFIER = False  # *ForSequenceClassification: a `score` head instead of the vocabulary's

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 ops: LayerOps | None = None) -> None:
        super().__init__()
        self.arch = cfg = self.arch_config(hf_config)
        self.ops = ops = ops or LayerOps()
        self.model = DecoderModel(cfg, attn_backend, dtype, ops)
        # Tied: the head shares the embedding parameter, so it is loaded (and stored) once.
        self.lm_head: LMHead | None = None
        self.score: Linear | None = None
        if cfg.num_labels:
            self.score = Linear(cfg.hidden_size, cfg.num_labels, False, dtype)
        else:
            self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, dtype)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.num_layers, self.num_heads, self.num_kv_heads = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
        self.head_size, self.vocab_size, self.hidden_size = cfg.head_dim, cfg.vocab_size, cfg.hidden_size
        self.max_position_embeddings = cfg.max_position_embeddings
        self.dtype = dtype
        self.gguf_stack: GGUFLayerStack | None = None  # all layers in one native call (after_load decides)

    @classmethod
    def arch_config(cls, c: Any) -> ArchConfig:
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cls.__name__}: unsupported hidden_act {act!r} (only 'silu')")
        num_heads = c.num_attention_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        return ArchConfig(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // num_heads,
            vocab_size=c.vocab_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
            rope=rope_parameters(c),
            qkv_bias=attention_bias if cls.QKV_BIAS is None else cls.QKV_BIAS,
            o_bias=attention_bias if cls.O_BIAS is None else cls.O_BIAS,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=cls.QK_NORM,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            num_labels=int(c.num_labels) if cls.CLASSIFIER else 0,
            sliding_windows=sliding_windows(c),
        )

    def after_materialize(self, device: torch.device) -> None:
        """Call once parameters live on `device` (e.g. after to_empty off the meta device): to_empty
        gives each module its own copy of a shared parameter, so the tie is restored here, and the rotary
        tables are built."""
        if self.arch.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope.build(device, self.dtype)

    def after_load(self) -> None:
        """Call once the weights are loaded: layers derive what their kernels want from them (packed weights, side
        by side in one arena in the order a step uses them)."""
        arena = cpu_linear.PackArena()
        for module in self.modules():
            if isinstance(module, Linear):
                module.after_load(arena)
        self.gguf_stack = GGUFLayerStack.build(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
        lora: LoRABatch | None = None,
        embeds_at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`on_layer_done(i)` runs once layer i has written its KV: a prefill node starts sending that
        layer's blocks while the next layers compute. `lora`: each row's adapter slot (None: no row has one).
        `embeds_at` (rows, embeddings): these rows take these input embeddings instead of their tokens' (an
        image's features at its placeholder tokens, models/llava.py)."""
        h = self.model.embed_tokens(input_ids)
        if embeds_at is not None:
            h[embeds_at[0]] = embeds_at[1].to(h.dtype)
        rope = self.ops.rope_prepare(self.rope.cos, self.rope.sin, positions)
        stacked = None
        if self.gguf_stack is not None and on_layer_done is None and lora is None and embeds_at is None:
            stacked = self.gguf_stack.forward(h, rope, kv_caches, meta)
        if stacked is not None:
            h, residual = stacked
        else:
            residual = None
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
                h, residual = layer(h, residual, rope, kv_cache, meta, lora)
                if on_layer_done is not None:
                    on_layer_done(i)
        h, _ = self.model.norm.add_forward(h, residual)
        return h

    def lora_targets(self) -> Iterator[tuple[int, Linear, dict[str, tuple[int, int]]]]:
        """The projections LoRA adapters may target, per layer: (layer, module, {HF name: (first row, rows)})."""
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            yield i, attn.qkv_proj, attn.qkv_proj.shards
            yield i, attn.o_proj, {"o_proj": (0, attn.o_proj.weight.shape[0])}
            yield i, mlp.gate_up_proj, mlp.gate_up_proj.shards
            yield i, mlp.down_proj, {"down_proj": (0, mlp.down_proj.weight.shape[0])}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head().forward(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of compute_logits(hidden) without materialising the logits (see LMHead)."""
        return self._head().greedy(hidden)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """A sequence classifier's outputs (fp32) for hidden states (its last token's: what HF pools)."""
        if self.score is None:
            raise RuntimeError(f"{type(self).__name__} has no classification head")
        return self.score(hidden).float()

    def _head(self) -> LMHead:
        if self.lm_head is None:
            raise RuntimeError(f"{type(self).__name__} classifies; it has no vocabulary head to generate with")
        return self.lm_head


class MistralForCausalLM(LlamaForCausalLM):
    QKV_BIAS = False
    O_BIAS = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    QKV_BIAS = True
    O_BIAS = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A cross-encoder or reranker on the Llama decoder: `score` on the last token's final hidden state."""

    CLASSIFIER = True


class Qwen2ForSequenceClassification(Qwen2ForCausalLM):
    CLASSIFIER = True


class Qwen3ForSequenceClassification(Qwen3ForCausalLM):
    CLASSIFIER = True


def sliding_windows(c: Any) -> tuple[int | None, ...]:
    """Per-layer attention window (None = full). Windows no shorter than the context are dropped."""
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None)
    if window is None or getattr(c, "use_sliding_window", True) is False:
        return (None,) * n
    if window >= getattr(c, "max_position_embeddings", math.inf):
        return (None,) * n
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    first = getattr(c, "max_window_layers", 0) if hasattr(c, "use_sliding_window") else 0
    return tuple(window if i >= first else None for i in range(n))
