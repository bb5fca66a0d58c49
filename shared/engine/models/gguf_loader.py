"""Load a llama-family model straight from its GGUF file, keeping the quantized tensors in their blocks
(`--quantization gguf`; the formats and kernels: gguf_blocks.py).

Every tensor goes where the safetensors loader would put it (weight_targets.py): a projection whose tensors (all
the shards of a fused one: q|k|v, gate|up) are blocks with a kernel gets them as a BlockWeight (shards of one type)
or BlockShards (of several, as Q4_K_M's q|k|v); the token embedding as a BlockEmbedding, which a tied LM head
shares. Everything else (norms, biases, F16, the types without a kernel, a fused projection with a shard of such
a type) is dequantized into its dense parameter, as the float32 conversion does, and logged once by type.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .gguf_blocks import TYPE_NAMES, BlockEmbedding, BlockShards, BlockWeight, block_rows, fits_blocks
from .llama import FusedLinear, Linear
from .weight_targets import copy_into, projection_owners, weight_targets

logger = logging.getLogger(__name__)

_EMBED = "model.embed_tokens.weight"


def load_gguf_weights(model: nn.Module, gguf_path: Path, round_to: torch.dtype | None = None) -> None:
    from gguf import GGUFReader

    from kvrelay.model_files.gguf import dequantized, hf_tensor_name, permuted_heads, unpermute_rotary_rows

    reader = GGUFReader(gguf_path)
    arch = model.arch
    targets, owners = weight_targets(model), projection_owners(model)
    shards: dict[Linear, dict[str, BlockWeight]] = {}
    embed: BlockWeight | None = None
    loaded: set[str] = set()
    dense: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name not in targets:
            raise ValueError(f"{gguf_path.name}: tensor {tensor.name} ({name}) is not part of this model")
        heads = permuted_heads(tensor.name, arch.num_heads, arch.num_kv_heads)
        qtype, cols = int(tensor.tensor_type), int(tensor.shape[0])
        keeps = fits_blocks(qtype, cols) and (name in owners or name == _EMBED)
        if keeps:
            raw = block_rows(tensor.data, qtype, cols)
            if heads is not None:
                raw = torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(raw.numpy(), heads)))
            blocks = BlockWeight(raw, qtype, cols)
            if name == _EMBED:
                embed = blocks
            else:
                module, shard = owners[name]
                shards.setdefault(module, {})[shard] = blocks
        else:
            values = torch.tensor(dequantized(tensor, arch.num_heads, arch.num_kv_heads))
            param, rows = targets[name]
            copy_into(param, rows, values if round_to is None else values.to(round_to), name)
            if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
                dense[tensor.tensor_type.name] += 1
        loaded.add(name)
    missing = sorted(set(targets) - loaded - ({"lm_head.weight"} if arch.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"{gguf_path.name} lacks tensors the model needs: {missing[:8]} ({len(missing)} in all)")
    kept = Counter[str]()
    for module, parts in shards.items():
        kept.update(_place(module, parts, round_to, dense))
    if embed is not None:
        kept[TYPE_NAMES[embed.qtype]] += 1
        model.model.embed_tokens = BlockEmbedding(embed, model.dtype)
        if arch.tie_word_embeddings:
            model.lm_head.use_blocks(embed)
    logger.info("GGUF weights kept in their blocks: %s; dequantized at load (no kernel): %s",
                _counts(kept), _counts(dense))


def _place(module: Linear, parts: dict[str, BlockWeight], round_to: torch.dtype | None,
           dense: Counter[str]) -> Counter[str]:
    """Give `module` its blocks when every shard came as blocks: one BlockWeight over all of them when they are of
    one type, else BlockShards (each shard its own); otherwise each shard that came as blocks is dequantized into
    the dense weight (the rest already is there). The types kept."""
    order = list(module.shards) if isinstance(module, FusedLinear) else list(parts)
    if all(s in parts for s in order):
        types = [parts[s].qtype for s in order]
        if len(set(types)) == 1:
            first = parts[order[0]]
            module.use_blocks(BlockWeight(torch.cat([parts[s].raw for s in order]), first.qtype, first.cols))
            return Counter({TYPE_NAMES[first.qtype]: 1})
        module.use_blocks(BlockShards([parts[s] for s in order]))
        return Counter(TYPE_NAMES[t] for t in types)
    for shard in parts:
        rows = module.shards[shard] if isinstance(module, FusedLinear) else None
        values = parts[shard].dequantize()
        copy_into(module.weight, rows, values if round_to is None else values.to(round_to), shard)
        dense[TYPE_NAMES[parts[shard].qtype]] += 1
    return Counter()


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(counter.items())) or "none"
