"""Matmuls of a few rows (decodes, speculative verification) through the native kernel that streams the
weight once per 8 rows (shared/engine/kernels/csrc/skinny_linear.cpp).

A general GEMM costs several times a matrix-vector product for 2..16 rows on CPU, which would make verifying
k drafts cost nearly k decode steps. The kernel's result for a row does not depend on the other rows of the
batch, so a decode's logits are bit-identical alone, batched, or verified with drafts beside it. Anything it
cannot take (other dtypes or devices, more than MAX_ROWS rows, no compiler) goes to torch.nn.functional.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine import kernels

MAX_ROWS = 32  # beyond this a GEMM's blocking wins


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        module = kernels.load()
        if module is not None:
            return module.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
