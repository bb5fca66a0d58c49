"""Weights kept in a GGUF file's own block formats (`--quantization gguf`): loaded as the file stores them, never
dequantized whole.

Q4_0, Q4_1 and Q8_0 tensors stay as their blocks of 32 weights (an fp16 scale, for Q4_1 an fp16 minimum, and
the 4- or 8-bit values), and the K-quants Q4_K, Q5_K and Q6_K as their super-blocks of 256 (sub-blocks of 32 or
16 with their own scales; kernels/csrc/gguf_kquants.h): one uint8 row of blocks per output row, the file's bytes
unchanged.

A linear layer of up to KERNEL_ROWS rows (decode steps, short prefill chunks) runs on them in the native kernel
(kernels/csrc/gguf_gemm.cpp: int8 activations and integer dot products, as llama.cpp does). Where the CPU has
AVX512-VNNI, Q4_0, Q4_1 and Q8_0 run there at any number of rows (`on_kernel`). Otherwise more rows (long prefill
chunks) dequantize the weight one tile of output rows at a time into a scratch buffer for the GEMM (in bf16 for a
bf16 model: 2.1-2.2x fp32's on an AVX512-BF16 CPU, docs/quantization.md), so the dense weight never exists whole.
Where every projection of a Llama-family model is such blocks, a step's layers run in one native call
(gguf_stack.py). The embedding dequantizes only the rows looked up; a tied LM head shares the embedding's blocks.

llama.cpp's converter permutes the rows of Q and K for its rotary layout; rows are independent of each other in
every block format, so the same permutation is undone on the block rows (kvrelay.model_files.gguf).

Other tensor types (F32 norms, F16, and the quantized types without a kernel here: Q5_0, Q5_1, Q2_K, Q3_K, the
IQ types), and K-quant tensors whose rows are not a whole number of super-blocks, are dequantized at load, as
without --quantization; the loader (gguf_loader.py) logs which.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine import kernels

logger = logging.getLogger(__name__)

BLOCK = 32
# ggml type number -> weights per block, bytes per block
BLOCK_ELEMS = {2: 32, 3: 32, 8: 32, 12: 256, 13: 256, 14: 256}
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 144, 13: 176, 14: 210}
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def fits_blocks(qtype: int, cols: int) -> bool:
    """Whether rows of `cols` weights of ggml type `qtype` can stay in their blocks here."""
    return qtype in BLOCK_BYTES and cols % BLOCK_ELEMS[qtype] == 0


def row_bytes(qtype: int, cols: int) -> int:
    return cols // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype]
# Up to this many rows the native kernel; past it, per-tile dequantization and the dense GEMM. The kernel's time
# grows with the rows (int8 dot products per row); the dense GEMM pays ~1.3 ms per weight to dequantize and
# repack it, then little per row: on a Zen 2 the kernel was faster at every count up to 128 rows, for the
# projections and the head alike (docs/results/2026-11-28-epyc-f23m49-zen2/NOTES.md).
KERNEL_ROWS = 128
_TILE_ROWS = 1024  # output rows dequantized at once past KERNEL_ROWS (1024 x 1536 fp32: 6 MiB)


def on_kernel(qtype: int, rows: int) -> bool:
    """Whether `rows` rows of x times blocks of ggml type `qtype` run on the native int8 kernel: up to KERNEL_ROWS,
    and at any count for the types it takes at any count here (Q4_0, Q4_1, Q8_0 with AVX512-VNNI, `gguf_any_rows`:
    faster than bf16's GEMM on dequantized tiles at every count, docs/quantization.md)."""
    native = kernels.load()
    return native is not None and (rows <= KERNEL_ROWS or native.gguf_any_rows(qtype))


@dataclass
class BlockWeight:
    """A [rows, cols] weight as GGUF blocks: `raw` is uint8 [rows, cols / 32 * block bytes]."""

    raw: torch.Tensor
    qtype: int  # ggml's type number
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"gguf: no kernel for ggml type {self.qtype}")
        if not fits_blocks(self.qtype, self.cols) or self.raw.shape[1] != row_bytes(self.qtype, self.cols):
            raise ValueError(f"gguf: {TYPE_NAMES[self.qtype]} rows of {self.cols} weights do not fit "
                             f"{self.raw.shape[1]} bytes")

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self, raw: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 rows of `raw` (default: all of them)."""
        raw = self.raw if raw is None else raw
        native = kernels.load()
        if native is not None:
            return native.gguf_dequantize(raw, self.qtype, self.cols)
        return _dequantize_torch(raw, self.qtype, self.cols)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias in x's dtype."""
        shape, rows = x.shape, x.reshape(-1, self.cols)
        if on_kernel(self.qtype, rows.shape[0]):
            y = kernels.load().gguf_gemm(rows, self.raw, self.qtype, bias)
        else:
            # A bf16 x runs bf16's GEMM (not fp32's) on the weights a dense bf16 model would hold.
            dt = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
            xt = rows.to(dt)
            parts = [F.linear(xt, self.dequantize(self.raw[start : start + _TILE_ROWS]).to(dt),
                              None if bias is None else bias[start : start + _TILE_ROWS].to(dt))
                     for start in range(0, self.rows, _TILE_ROWS)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return y.to(x.dtype).reshape(*shape[:-1], self.rows)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows of `ids` (an embedding lookup), as `dtype`."""
        flat = ids.reshape(-1)
        return self.dequantize(self.raw.index_select(0, flat)).to(dtype).reshape(*ids.shape, self.cols)


@dataclass
class BlockShards:
    """A fused projection (q|k|v, gate|up) whose shards came as blocks of different types (llama.cpp's Q4_K_M
    keeps attn_v in Q6_K beside Q4_K q and k): each shard keeps its own blocks, outputs side by side."""

    parts: list[BlockWeight]

    def __post_init__(self) -> None:
        if not self.parts or len({p.cols for p in self.parts}) != 1:
            raise ValueError("gguf: a fused projection's shards must be one or more, of equal width")
        starts = np.cumsum([0] + [p.rows for p in self.parts]).tolist()
        self._ranges = list(zip(self.parts, starts[:-1], starts[1:], strict=True))  # (shard, first row, end)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias in x's dtype, each shard on its own blocks."""
        return torch.cat([p.linear(x, None if bias is None else bias[a:b]) for p, a, b in self._ranges], dim=-1)


@contextmanager
def kernel_on_every_row() -> Iterator[None]:
    """Every row on the int8 kernel meanwhile, prefill chunks included: what a decode step computes, for the
    accuracy benchmark's perplexity (kvrelay.bench.accuracy)."""
    global KERNEL_ROWS
    saved, KERNEL_ROWS = KERNEL_ROWS, 1 << 62
    try:
        yield
    finally:
        KERNEL_ROWS = saved


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks; a lookup dequantizes the rows it reads."""

    def __init__(self, blocks: BlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks, self.dtype = blocks, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.embed(ids, self.dtype)


def block_rows(data: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    """A GGUF tensor's raw bytes as uint8 [rows, row bytes] (a copy: the reader's map is read-only)."""
    flat = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return torch.from_numpy(flat.copy()).reshape(-1, row_bytes(qtype, cols))


def _dequantize_torch(raw: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """The portable dequantization (no native kernels): the same values as gguf_dequantize."""
    if BLOCK_ELEMS[qtype] != BLOCK:  # the K-quants: the gguf package's reference (numpy)
        import gguf

        values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], cols)
    blocks = raw.reshape(raw.shape[0], cols // BLOCK, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == 8:
        return (blocks[..., 2:].contiguous().view(torch.int8).float() * d).reshape(raw.shape[0], cols)
    start = 4 if qtype == 3 else 2
    qs = blocks[..., start:].to(torch.int16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    low = blocks[..., 2:4].contiguous().view(torch.float16).float() if qtype == 3 else -8.0 * d
    return (q * d + low).reshape(raw.shape[0], cols)
