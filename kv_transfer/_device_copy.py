"""The block copy of a CUDA IPC transfer (shm.py's receiver, out of a sender's memory opened by _cuda_ipc.py):
one layer's blocks from the sender's cache into the reserved ones, enqueued on the current stream.

A layer cache [2, blocks, ...] is seen as rows, [2 * blocks, words]: a block's keys, or its values, are one
row, in 8-byte words where the block size and both sides' alignment allow, else in bytes (fp8 moves too: only
bytes move). A layer whose blocks form few runs, consecutive on both sides, moves as one device memcpy per run
and side (keys, values). Any other moves row by row, by one of two means:

- fused: one Triton kernel that reads each src row and writes it to its dst row: every byte is read once and
  written once, as by a memcpy. A receiver compiles it when its caches are registered and checks its result
  on a few rows (warm_up); where Triton is missing or that check fails it uses the other means.
- torch: index_select (gather into staging, at most 32 MiB at a time: the receiver's GPU memory is its KV
  cache's) then index_copy_ (scatter): twice the memory traffic of a memcpy, unless one side is a single run,
  which is gathered straight into, or scattered straight out of.

Row numbers go to the device once per transfer and stream (RowIndices): every layer of a transfer moves the
same blocks. Block ids are checked against both caches before anything is launched: an index out of range
would fault the device, not raise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.kv_transfer._shm_io import copy_plan

logger = logging.getLogger(__name__)

_STAGING_BYTES = 32 << 20  # gathered rows held at once (torch means)
_MAX_PROGRAM_WORDS = 1024  # words of a row one program of the fused kernel copies


@dataclass(frozen=True)
class _Plan:
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray]  # copy_plan: (dst, src offsets, sizes) in bytes
    src_run: int | None  # the first src block if the src blocks are one run
    dst_run: int | None


@functools.lru_cache(maxsize=64)  # every layer of a transfer moves the same blocks
def _plan(src: tuple[int, ...], dst: tuple[int, ...], src_blocks: int, dst_blocks: int, block_nbytes: int) -> _Plan:
    if len(src) != len(dst) or any(not 0 <= b < src_blocks for b in src) or any(not 0 <= b < dst_blocks for b in dst):
        raise ValueError("copy outside a layer cache")  # index kernels would fault the device: never launch them
    return _Plan(copy_plan(list(src), list(dst), src_blocks, dst_blocks, block_nbytes), _run(src), _run(dst))


def _run(ids: tuple[int, ...]) -> int | None:
    return ids[0] if ids and ids == tuple(range(ids[0], ids[0] + len(ids))) else None


class RowIndices:
    """Row numbers of a transfer's blocks on the device, keys' rows then values', made once per transfer and
    stream (an index tensor is only used on the stream it was made on, so any thread may drop it)."""

    def __init__(self, capacity: int = 64) -> None:
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, ids: tuple[int, ...], num_blocks: int, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (ids, num_blocks, device, stream)
        with self._lock:
            rows = self._cache.get(key)
            if rows is not None:
                self._cache.move_to_end(key)
                return rows
        blocks = np.asarray(ids, dtype=np.int64)
        rows = torch.from_numpy(np.concatenate((blocks, blocks + num_blocks))).to(device)
        with self._lock:
            self._cache[key] = rows
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return rows


def copy_blocks(
    dst: torch.Tensor, src: torch.Tensor, src_ids: list[int], dst_ids: list[int], src_blocks: int, dst_blocks: int,
    block_nbytes: int, *, max_direct_runs: int, indices: RowIndices, fused: bool,
) -> int:
    """Copy blocks of one layer cache [2, blocks, ...] from src to dst (flat byte tensors on one device), enqueued
    on the current stream; returns the bytes copied. `fused`: by the fused kernel (see warm_up), else by torch's
    index kernels."""
    plan = _plan(tuple(src_ids), tuple(dst_ids), src_blocks, dst_blocks, block_nbytes)
    dst_off, src_off, sizes = plan.pieces
    nbytes = int(sizes.sum())
    if dst.numel() < 2 * dst_blocks * block_nbytes or src.numel() < 2 * src_blocks * block_nbytes:
        raise ValueError("copy outside a layer cache")
    if len(sizes) <= 2 * max_direct_runs:  # a few runs: one memcpy each, keys and values
        for do, so, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist()):
            dst[do : do + n].copy_(src[so : so + n])
        return nbytes
    word = torch.int64 if block_nbytes % 8 == 0 and _aligned(src) and _aligned(dst) else torch.uint8
    s, d = _rows(src, src_blocks, block_nbytes, word), _rows(dst, dst_blocks, block_nbytes, word)
    if fused:
        src_rows = indices.get(tuple(src_ids), src_blocks, src.device)
        _copy_rows(s, d, src_rows, indices.get(tuple(dst_ids), dst_blocks, dst.device))
    else:
        _index_copy(s, d, src_ids, dst_ids, src_blocks, dst_blocks, plan, indices)
    return nbytes


def _index_copy(s: torch.Tensor, d: torch.Tensor, src_ids: list[int], dst_ids: list[int], src_blocks: int,
                dst_blocks: int, plan: _Plan, indices: RowIndices) -> None:
    count = len(src_ids)
    if plan.dst_run is not None:  # gather straight into the run: keys, then values
        rows = indices.get(tuple(src_ids), src_blocks, s.device)
        for kind in (0, 1):
            start = kind * dst_blocks + plan.dst_run
            torch.index_select(s, 0, rows[kind * count : (kind + 1) * count], out=d[start : start + count])
    elif plan.src_run is not None:  # scatter straight out of the run
        rows = indices.get(tuple(dst_ids), dst_blocks, d.device)
        for kind in (0, 1):
            start = kind * src_blocks + plan.src_run
            d.index_copy_(0, rows[kind * count : (kind + 1) * count], s[start : start + count])
    else:
        src_rows = indices.get(tuple(src_ids), src_blocks, s.device)
        dst_rows = indices.get(tuple(dst_ids), dst_blocks, d.device)
        step = max(1, _STAGING_BYTES // (s.shape[1] * s.element_size()))
        for lo in range(0, 2 * count, step):
            d.index_copy_(0, dst_rows[lo : lo + step], s.index_select(0, src_rows[lo : lo + step]))


def _aligned(flat: torch.Tensor) -> bool:
    return flat.storage_offset() % 8 == 0 and flat.data_ptr() % 8 == 0


def _rows(flat: torch.Tensor, num_blocks: int, block_nbytes: int, word: torch.dtype) -> torch.Tensor:
    """A layer's flat bytes as [2 * blocks, words]."""
    return flat[: 2 * num_blocks * block_nbytes].view(word).view(2 * num_blocks, -1)


# -- the fused kernel ------------------------------------------------------------------------------------------


@functools.cache
def _kernel() -> Callable:
    """The fused row copy, built on first use: Triton is imported only where it is wanted (a CUDA receiver), and
    TRITON_INTERPRET=1 (read when the kernel is built) runs it on CPU tensors, as the tests do."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(src, dst, src_rows, dst_rows, row_words, BLOCK: tl.constexpr):  # noqa: N803 - Triton's style
        # Program (r, c) copies words [c * BLOCK, (c + 1) * BLOCK) of row r of the plan.
        r = tl.program_id(0)
        words = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = words < row_words
        s = tl.load(src_rows + r)  # int64: row * row_words cannot overflow
        d = tl.load(dst_rows + r)
        tl.store(dst + d * row_words + words, tl.load(src + s * row_words + words, mask=inside), mask=inside)

    return copy_rows


def _copy_rows(s: torch.Tensor, d: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """d[dst_rows[i]] = s[src_rows[i]] for every i, in one launch on the current stream."""
    row_words = s.shape[1]
    block = min(_MAX_PROGRAM_WORDS, 1 << (row_words - 1).bit_length())
    grid = (len(src_rows), -(-row_words // block))
    _kernel()[grid](s, d, src_rows, dst_rows, row_words, BLOCK=block)


def warm_up(device: torch.device, block_nbytes: int) -> bool:
    """Whether the fused kernel can copy this layout's rows on `device`: Triton imports, the kernel compiles
    (now, for these row sizes, not inside the first transfer) and moves a few rows exactly."""
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for word in (torch.int64, torch.uint8) if block_nbytes % 8 == 0 else (torch.uint8,):
                size = block_nbytes // torch.empty((), dtype=word).element_size()
                src = torch.arange(4 * size, device=device).to(word).view(4, size)
                dst = torch.zeros_like(src)
                rows = torch.tensor([2, 0, 3], device=device), torch.tensor([1, 3, 0], device=device)
                _copy_rows(src, dst, *rows)
                expected = torch.zeros_like(src)
                expected[rows[1]] = src[rows[0]]
                if not torch.equal(dst, expected):  # (reading dst waits for the kernel)
                    raise RuntimeError("the fused kernel moved the wrong bytes")
    except Exception as e:  # noqa: BLE001 - any failure means the torch means, which work everywhere
        logger.warning("shm connector: no fused block copy on %s (%r); torch gather/scatter kernels instead", device, e)
        return False
    return True
