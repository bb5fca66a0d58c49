"""Where each checkpoint tensor goes in our model: its parameter, and its rows when the parameter is a fused
projection. Both loaders (loader.py for safetensors, gguf_loader.py for a GGUF's blocks) place tensors by it."""

from __future__ import annotations

import torch
from torch import nn

from .llama import FusedLinear, Linear


def weight_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, tuple[int, int] | None]]:
    """HF tensor name -> (our parameter, its row range when the parameter is a fused projection)."""
    targets: dict[str, tuple[nn.Parameter, tuple[int, int] | None]] = {}
    for module_name, module in model.named_modules():
        prefix = module_name.rpartition(".")[0]
        for pname, param in module.named_parameters(recurse=False):
            if isinstance(module, FusedLinear):
                for shard, rows in module.shards.items():
                    targets[f"{prefix}.{shard}.{pname}"] = (param, rows)
            else:
                targets[f"{module_name}.{pname}"] = (param, None)
    return targets


def copy_into(param: nn.Parameter, rows: tuple[int, int] | None, tensor: torch.Tensor, name: str) -> None:
    dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
    if dest.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dest.shape)}")
    dest.copy_(tensor)


def projection_owners(model: nn.Module) -> dict[str, tuple[Linear, str]]:
    """HF weight name -> (the projection holding it, its shard name: the HF name's module part). The loaders of
    quantized weights (GGUF blocks, AWQ/GPTQ/FP8 tiles) hand each projection its weight whole, shards stacked."""
    owners: dict[str, tuple[Linear, str]] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        prefix, _, own = module_name.rpartition(".")
        for shard in (module.shards if isinstance(module, FusedLinear) else {own: None}):
            owners[f"{prefix}.{shard}.weight" if prefix else f"{shard}.weight"] = (module, shard)
    return owners
