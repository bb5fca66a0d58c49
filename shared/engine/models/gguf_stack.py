"""Every decoder layer in one native call, for a Llama-family model whose projections are all GGUF blocks.

A decode step of the default model (Q4_1, 30 layers) on two cores spent about as long in Python between the
kernels (module calls, views, argument parsing: ~10 kernels a layer) as in the GEMMs themselves; the second
OpenMP thread spun idle for that time. `kernels.gguf_decoder_layers` runs the same kernels in the same order
with the same roundings as DecoderLayer.forward, so its output is the same bits (tests/engine/test_gguf_stack.py),
and the Python path stays the reference and the fallback.

It applies when every layer's projections are GGUF blocks (a fused one's shards may differ in type) without
biases, with plain RMSNorms, no q/k norm, no sliding window, the fused CPU layer ops and the torch attention
backend's native kernel (`build` checks once), and per step when the rows fit the GGUF kernel (no dequantized
tiles), no row uses a LoRA adapter, no row takes image features, and no caller waits on each layer (a prefill
node streaming KV layer by layer).
"""

from __future__ import annotations

import torch
from torch import nn

from kvrelay.engine import kernels
from kvrelay.engine.attention.base import AttentionMetadata
from kvrelay.engine.attention.torch_backend import TorchAttentionBackend

from . import gguf_blocks
from .gguf_blocks import BlockShards, BlockWeight


class GGUFLayerStack:
    def __init__(self, native, backend: TorchAttentionBackend, tensors: list[torch.Tensor], qtypes: list[int],
                 parts: list[int], num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float) -> None:
        self._native, self._backend = native, backend
        self._tensors, self._qtypes, self._parts = tensors, qtypes, parts
        self._kinds = sorted(set(qtypes))  # the block types: whether a step of so many rows runs here
        self._shape = (num_heads, num_kv_heads, head_dim)
        self._eps, self._scale = eps, scale

    @classmethod
    def build(cls, model: nn.Module) -> GGUFLayerStack | None:
        """The stack for `model` (a models.llama.LlamaForCausalLM, which this module may not import: it imports
        this one) once its weights are loaded, or None where it does not apply."""
        native = kernels.load()
        layers = list(model.model.layers)
        if native is None or not hasattr(native, "gguf_decoder_layers") or not model.ops.native or not layers:
            return None
        # What the layers' own forwards use, read from them: the stack must compute exactly what they do.
        first = layers[0]
        backend, scale, eps = first.self_attn.backend, first.self_attn.scale, first.input_layernorm.eps
        if not isinstance(backend, TorchAttentionBackend):
            return None
        tensors: list[torch.Tensor] = []
        qtypes: list[int] = []
        parts: list[int] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (attn.backend is not backend or attn.scale != scale or attn.q_norm is not None
                    or attn.backend_kwargs or any(n.eps != eps for n in norms)):
                return None  # another backend, scale or norm; q/k norms; a sliding window
            tensors += [n.weight for n in norms]
            for projection in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                blocks = projection.blocks
                shards = blocks.parts if isinstance(blocks, BlockShards) else [blocks]
                if projection.bias is not None or not all(isinstance(b, BlockWeight) for b in shards):
                    return None
                tensors += [b.raw for b in shards]
                qtypes += [b.qtype for b in shards]
                parts.append(len(shards))
        cfg = model.arch
        return cls(native, backend, tensors, qtypes, parts, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps, scale)

    def forward(self, h: torch.Tensor, rope: tuple, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the last layer, as the layers' own forwards give them; None when this step
        must take the Python path (rows past the GGUF kernel's, or attention off the native kernel)."""
        rows = h.shape[0]
        if (not all(gguf_blocks.on_kernel(q, rows) for q in self._kinds) or not kv_caches
                or not self._backend.runs_native(h.dtype, kv_caches[0], meta)):
            return None
        cos, sin, positions = rope
        num_heads, num_kv_heads, head_dim = self._shape
        hidden, residual = self._native.gguf_decoder_layers(
            h, self._tensors, self._qtypes, self._parts, kv_caches, cos, sin, positions, meta.slot_mapping,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.num_decodes, num_heads, num_kv_heads,
            head_dim, self._eps, self._scale)
        return hidden, residual
