"""Rotary position embeddings of the llama family: the config's rope parameters (default and llama3 scaling) and
the cos/sin tables a model builds once on its device."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(c: Any) -> dict[str, Any]:
    """The rope settings, wherever this transformers version keeps them (rope_parameters or rope_scaling)."""
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    layer_types = set(getattr(c, "layer_types", None) or ())
    if layer_types & params.keys():
        raise ValueError("per-layer-type rope parameters are not supported")
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params["rope_theta"] = params.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", getattr(c, "max_position_embeddings", 8192))
    partial = params.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    return params


class RotaryEmbedding:
    """Neox-style rotary embedding with cos/sin precomputed for every position up to the model's limit."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        self.head_dim, self.max_positions = head_dim, max_positions
        self.params = params
        inverse_frequencies(head_dim, params, torch.device("cpu"))  # reject unsupported types early
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        # As HF: angles in fp32, cos/sin rounded to the activation dtype.
        cpu = torch.device("cpu")
        inv_freq = inverse_frequencies(self.head_dim, self.params, cpu)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=cpu).float()
        freqs = positions[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)


def inverse_frequencies(head_dim: int, params: dict[str, Any], device: torch.device) -> torch.Tensor:
    # An explicit device: the model is built under a meta-device context.
    base, rope_type = params["rope_theta"], params["rope_type"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_scaling(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
