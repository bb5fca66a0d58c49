"""How a linear layer runs on CPU: the native skinny kernel for a few fp32 rows, oneDNN on a weight packed
once at load for everything else.

- Up to SKINNY_ROWS fp32 rows (decodes of a small batch, drafts being verified): the skinny kernel
  (shared/engine/kernels/csrc/skinny_linear.cpp) streams the weight once per 8 rows, and a row's result does
  not depend on the rows beside it, so a decode's logits are bit-identical alone, batched, or verified with
  drafts beside it. At one row it runs about 2x faster than oneDNN.
- Otherwise: oneDNN's matmul on the weight reordered once (`pack`) into its blocked layout. `F.linear` hands
  the plain weight to the GEMM, which reorders (oneDNN, bf16) or packs (MKL, fp32) it again on every call;
  for the 8..64-row GEMMs of decode steps that costs as much as the multiply itself (1.2-2x slower measured
  on AVX512-BF16 and AVX2 machines, docs/benchmarks.md).
- Anything neither takes (other devices or dtypes, torch without oneDNN, no compiler): `F.linear`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from shared.engine import kernels

logger = logging.getLogger(__name__)

SKINNY_ROWS = 8  # at one row the skinny kernel is ~2x oneDNN; by 8-16 rows oneDNN's blocking catches up
SKINNY_ROWS_UNPACKED = 32  # against F.linear (no packed weight) the skinny kernel wins up to 32 rows
DISABLE_ENV = "KVRELAY_DISABLE_PACKED_LINEAR"  # compare against plain F.linear (benchmarks, bisecting)
_PACKABLE = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's own layout for `linear`, or None where that path is not available."""
    if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.dim() != 2
            or not torch.backends.mkldnn.is_available() or os.environ.get(DISABLE_ENV)):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError) as e:  # a torch build without these ops: the plain path
        logger.warning("oneDNN weight packing unavailable (%s); linear layers use F.linear", e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b; `packed` is `pack(weight)` (None: not packed)."""
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype:
        limit = SKINNY_ROWS if packed is not None else SKINNY_ROWS_UNPACKED
        if x.shape[0] <= limit and x.dtype == torch.float32 and weight.is_contiguous():
            module = kernels.load()
            if module is not None:
                return module.skinny_linear(x, weight, bias)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
