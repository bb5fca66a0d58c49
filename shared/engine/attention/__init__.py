"""Attention backends over the paged KV cache: `get_attention_backend(name, device)`."""

from __future__ import annotations

import importlib.util
import logging

import torch

from .base import AttentionBackend, AttentionMetadata, write_kv
from .torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")

__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "flash_attn_available",
    "triton_available",
    "get_attention_backend",
    "write_kv",
]


def flash_attn_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def triton_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """'auto': on CUDA triton (paged, in place; CUDA builds of torch ship it), else flash_attn when installed;
    the portable torch backend elsewhere."""
    if name == "auto":
        if triton_available(device):
            try:
                return get_attention_backend("triton", device)
            except ImportError as exc:
                logger.warning("triton unusable (%s); trying the other attention backends", exc)
        if flash_attn_available(device):
            try:
                return get_attention_backend("flash_attn", device)
            except ImportError as exc:  # installed but broken (e.g. built for another torch): stay up
                logger.warning("flash-attn unusable (%s); using the torch attention backend", exc)
        name = "torch"
    if name == "torch":
        # The native kernels are CPU code: a CUDA engine never calls them, so it does not build them either.
        return TorchAttentionBackend(use_native=torch.device(device).type == "cpu")
    if name == "triton":
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'triton' needs a CUDA device, got {str(device)!r}")
        from .triton_backend import TritonAttentionBackend  # imports triton, which raises if absent

        return TritonAttentionBackend()
    if name == "flash_attn":
        if torch.device(device).type != "cuda":
            raise ValueError(f"attention backend 'flash_attn' needs a CUDA device, got {str(device)!r}")
        from .flash_backend import FlashAttentionBackend  # imports flash_attn, which raises if absent

        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
