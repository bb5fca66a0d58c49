"""How a linear layer runs on CPU: each weight is packed once at load for the kernels that fit each row count.

- Up to `small_rows` rows (a decode step's batch, drafts being verified): the native small GEMM
  (shared/engine/kernels/csrc/small_gemm.cpp). It streams the weight in panels, fetching the next while it
  computes, where oneDNN waits on DRAM for the weights (which do not fit in cache at these row counts) and pays
  a dispatch cost per call; `small_rows` is where oneDNN catches up (SMALL_ROWS below). A row's result does not
  depend on the rows beside it, so a decode's logits are bit-identical alone, batched, or verified with drafts
  beside it. With AMX, bf16 runs on the tile units (SMALL_ROWS_AMX_BF16).
- Without the small GEMM (no compiler, or a CPU without AVX2), up to SKINNY_ROWS fp32 rows: the skinny kernel
  (skinny_linear.cpp; same row independence).
- With AMX, bf16 past SMALL_ROWS_AMX_BF16: whichever of the two was measured faster at that weight shape and row
  count on this machine (gemm_plan).
- With AMX, an MLP's gate|up projection and SiLU * up run as one kernel at every row count (pack_silu_mul),
  which beat oneDNN followed by silu_mul at every row count measured.
- Otherwise: oneDNN's matmul on the weight reordered once into its blocked layout. `F.linear` hands the plain
  weight to the GEMM, which reorders (oneDNN, bf16) or packs (MKL, fp32) it again on every call; for the 8..64-
  row GEMMs of decode steps that costs as much as the multiply itself.
- Anything none takes (other devices or dtypes, torch without oneDNN, no compiler): `F.linear`.

The small GEMM's packed weights of a model sit side by side in a few large buffers (PackArena), in the order
the layers use them: each is too small for a 2 MiB huge page of its own, and a decode step streams all of them
from DRAM, so one buffer puts them on huge pages and makes the walk sequential.

The measurements behind these choices are in docs/results/ (2026-11-25-zen5, 2026-11-26-zen5-avx2emu and
2026-11-26-xeon-amx, NOTES.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrelay.engine import host_memory, kernels
from kvrelay.engine.models import gemm_plan

logger = logging.getLogger(__name__)

# The most rows the small GEMM takes, by the vector unit it was built for: measured against oneDNN on SmolLM2's
# 30 layers (AMD EPYC Zen 5, 2 threads; AVX2 with the kernels built for x86-64-v3 and oneDNN held to AVX2).
SMALL_ROWS = {"avx512-bf16": 256, "avx512": 256, "avx2": 64}
# With AMX the small GEMM runs bf16 on the tile units too (the packed blocks are its B tiles), and stays ahead
# of oneDNN's AMX GEMM to 128 rows (30 SmolLM2 layers on an AMX Xeon).
# Past 128 neither wins throughout, by weight shape and row count: gemm_plan measures which does, once per machine.
SMALL_ROWS_AMX_BF16 = 128
SKINNY_ROWS = 8  # at one row the skinny kernel is ~2x oneDNN; by 8-16 rows oneDNN's blocking catches up
SKINNY_ROWS_UNPACKED = 32  # against F.linear (no packed weight) the skinny kernel wins up to 32 rows
DISABLE_ENV = "KVRELAY_DISABLE_PACKED_LINEAR"  # compare against plain F.linear (benchmarks, bisecting)
DISABLE_SMALL_ENV = "KVRELAY_DISABLE_SMALL_GEMM"  # oneDNN at every row count (A/B)
_PACKABLE = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in the layouts of the kernels that take it here (None: that kernel is not used)."""

    onednn: torch.Tensor | None
    small: torch.Tensor | None
    out_features: int
    small_rows: int = 0  # up to this many rows `small` is used
    plan: gemm_plan.RowPlan | None = None  # past small_rows, where `small` is measured faster than oneDNN

    def takes_small(self, rows: int) -> bool:
        if self.small is None:
            return False
        return rows <= self.small_rows or (self.plan is not None and self.plan.takes_small(rows))


class PackArena:
    """Packed weights copied side by side into buffers of `chunk_bytes`, in the order they are adopted.

    A buffer is allocated when the last one is full, on huge pages (kvrelay.engine.host_memory, as the KV caches);
    at most the last buffer's unused tail (under `chunk_bytes`) is spent.
    """

    ALIGN = 64  # every weight starts on a cache line

    def __init__(self, chunk_bytes: int = 16 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def adopt(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed`'s values in the arena (a view of the same shape and dtype), or `packed` itself if it is larger
        than a buffer."""
        nbytes = packed.numel() * packed.element_size()
        if nbytes > self.chunk_bytes or not packed.is_contiguous():
            return packed
        if self._buffer is None or self._used + nbytes > self.chunk_bytes:
            self._buffer = host_memory.zeros((self.chunk_bytes,), torch.uint8, packed.device)
            self._used = 0
        home = self._buffer[self._used : self._used + nbytes].view(packed.dtype).view(packed.shape).copy_(packed)
        self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return home


def _small_gemm_packs(weight: torch.Tensor):
    module = kernels.load()
    if module is None or not module.small_gemm_available() or os.environ.get(DISABLE_SMALL_ENV):
        return None
    if weight.dtype == torch.float32:
        return module
    # bf16 pairs need AVX512-BF16 and an even input size
    if weight.dtype == torch.bfloat16 and module.attention_isa() == "avx512-bf16" and weight.shape[1] % 2 == 0:
        return module
    return None


def pack(weight: torch.Tensor, onednn: bool = True, arena: PackArena | None = None) -> PackedWeight | None:
    """`weight` [out, in] in the layouts `linear` uses (oneDNN's only if asked), or None where only the plain
    path is available. The small GEMM's layout goes into `arena` if one is given."""
    if (weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.dim() != 2
            or os.environ.get(DISABLE_ENV)):
        return None
    reordered = small = None
    if onednn and torch.backends.mkldnn.is_available():
        try:
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        except (AttributeError, RuntimeError) as e:  # a torch build without these ops: the plain path
            logger.warning("oneDNN weight packing unavailable (%s); linear layers use F.linear", e)
    module = _small_gemm_packs(weight)
    small_rows, plan = 0, None
    if module is not None:
        small, small_rows = module.pack_small_gemm(weight), SMALL_ROWS[module.attention_isa()]
        if arena is not None:
            small = arena.adopt(small)
        if weight.dtype == torch.bfloat16 and module.amx_tiles():
            small_rows = SMALL_ROWS_AMX_BF16
            if reordered is not None:
                plan = gemm_plan.plan(weight.shape[0], weight.shape[1], small_rows, module)
    if reordered is None and small is None:
        return None
    return PackedWeight(reordered, small, weight.shape[0], small_rows, plan)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x W^T + b; `packed` is `pack(weight)` (None: not packed)."""
    if x.dim() == 2 and x.device.type == "cpu" and x.dtype == weight.dtype:
        rows = x.shape[0]
        if packed is not None and packed.takes_small(rows):
            return kernels.load().small_gemm(x.contiguous(), packed.small, packed.out_features, bias)
        onednn = packed.onednn if packed is not None else None
        limit = SKINNY_ROWS if onednn is not None else SKINNY_ROWS_UNPACKED
        if rows <= limit and x.dtype == torch.float32 and weight.is_contiguous():
            module = kernels.load()
            if module is not None:
                return module.skinny_linear(x, weight, bias)
        if onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_silu_mul(weight: torch.Tensor, arena: PackArena | None = None) -> torch.Tensor | None:
    """A gate|up weight [2n, K] (gate rows first) for `silu_mul_linear`, its 16-row blocks of gate and up
    alternating (in `arena` if one is given), or None where that kernel does not run (it needs AMX and bf16)."""
    rows, k = weight.shape
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or rows % 32 or k % 32
            or os.environ.get(DISABLE_ENV)):
        return None
    module = _small_gemm_packs(weight)
    if module is None or not module.amx_tiles():
        return None
    blocks = weight.view(2, rows // 32, 16, k).transpose(0, 1).reshape(rows, k)
    packed = module.pack_small_gemm(blocks)
    return arena.adopt(packed) if arena is not None else packed


def silu_mul_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """SiLU(x G^T) * (x U^T) for bf16 rows x and `packed` = pack_silu_mul(weight), bit for bit the product of
    `linear` (on the small GEMM) and `LayerOps.silu_mul`, without writing the gate|up activations."""
    outputs = packed.shape[0] * 16 // 2  # half of the packed blocks' 16 columns each are gate, half up
    return kernels.load().small_gemm_silu_mul(x.contiguous(), packed, outputs)


def greedy(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """argmax over the outputs of `linear(x, weight, None, packed)` per row, where the small GEMM takes x (no
    logits written); None elsewhere."""
    if (packed is not None and packed.small is not None and x.dim() == 2 and x.device.type == "cpu"
            and x.shape[0] <= packed.small_rows):
        return kernels.load().small_gemm_argmax(x.contiguous(), packed.small, packed.out_features)
    return None
