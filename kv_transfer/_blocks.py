"""Turning a layer's block list into wire messages (segments) and back, shared by the wire connectors.

A layer cache is [2, num_blocks, block_size, kv_heads, head_size], so one run of consecutive block ids is one
contiguous slab of keys and one of values: such runs go on the wire (and land) in place, without a copy. Many
short runs are instead gathered into one staging tensor, because one memcpy beats many small
messages. The receiver mirrors this from the segment list alone, so both sides may be fragmented differently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

BOTH = 2  # segment kind covering keys and values together, staged as [2, count, ...]


@dataclass(frozen=True)
class Segment:
    kind: int  # 0 keys, 1 values, BOTH
    pos: int  # first index into the transfer's block list
    count: int

    def to_list(self) -> list[int]:
        return [self.kind, self.pos, self.count]

    @classmethod
    def from_list(cls, data: list[int]) -> Segment:
        return cls(*data)


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in list, first block id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


def plan_segments(src_block_ids: list[int], max_direct_runs: int, max_message_blocks: int) -> list[Segment]:
    """Wire messages for one layer. max_message_blocks caps a message's size (in K or V blocks): over TCP
    and shared memory, UCX moves messages of about 1 MiB faster than larger ones."""
    runs = block_runs(src_block_ids)
    if len(runs) > max_direct_runs:
        step = max(1, max_message_blocks // 2)  # a BOTH message carries keys and values
        return [
            Segment(BOTH, p, min(step, len(src_block_ids) - p)) for p in range(0, len(src_block_ids), step)
        ]
    return [
        Segment(kind, p, min(max_message_blocks, pos + length - p))
        for pos, _, length in runs
        for p in range(pos, pos + length, max_message_blocks)
        for kind in (0, 1)
    ]


def _as_run(block_ids: list[int]) -> int | None:
    """First id if the ids are one run of consecutive blocks."""
    first = block_ids[0]
    return first if block_ids == list(range(first, first + len(block_ids))) else None


def gather(
    cache: torch.Tensor, block_ids: list[int], kind: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The given blocks' keys, values (kind 0/1) or both (BOTH: [2, n, ...]) in one contiguous tensor."""
    if out is None:
        out = _empty(cache, kind, len(block_ids))
    nlead = 2 if kind == BOTH else 1
    if cache.is_cuda:
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        torch.index_select(_part(cache, kind), nlead - 1, index, out=out)
    else:
        np.take(_rows(_part(cache, kind), nlead), block_ids, axis=nlead - 1, out=_rows(out, nlead))
    return out


def scatter(cache: torch.Tensor, block_ids: list[int], kind: int, data: torch.Tensor) -> None:
    """The inverse of gather: write data into the given blocks."""
    if cache.is_cuda:
        index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        part = _part(cache, kind)
        if part.element_size() == 1:  # fp8: torch has no index_copy_ for it, so the bytes move
            part, data = part.view(torch.uint8), data.view(torch.uint8)
        part.index_copy_(1 if kind == BOTH else 0, index, data)
        return
    nlead = 2 if kind == BOTH else 1
    rows = _rows(_part(cache, kind), nlead)
    index = np.asarray(block_ids)
    if kind == BOTH:
        rows[:, index] = _rows(data, nlead)
    else:
        rows[index] = _rows(data, nlead)


# On CPU the copies go through numpy: single-threaded, so a transfer thread never fights the model's OpenMP
# threads for cores (torch.index_copy_ stalls for milliseconds per layer in that fight on busy cores), while
# numpy's row copies run near memcpy speed.
def _part(cache: torch.Tensor, kind: int) -> torch.Tensor:
    return cache if kind == BOTH else cache[kind]


def _rows(t: torch.Tensor, nlead: int) -> np.ndarray:
    """A contiguous tensor as a numpy uint8 array of block rows: [*lead, bytes per block]."""
    return t.view(torch.uint8).reshape(*t.shape[:nlead], -1).numpy()


def _empty(cache: torch.Tensor, kind: int, count: int) -> torch.Tensor:
    lead = (2, count) if kind == BOTH else (count,)
    return torch.empty((*lead, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)


class StagingPool:
    """Reuses staging buffers. UCX registers a buffer's memory on first use and drops the registration when
    it is freed, so a fresh buffer per layer costs more than the copy into it."""

    def __init__(self, max_bytes: int = 256 << 20):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._bytes, self._max_bytes = 0, max_bytes
        self._lock = threading.Lock()

    def take(self, cache: torch.Tensor, seg: Segment) -> torch.Tensor:
        lead = (2, seg.count) if seg.kind == BOTH else (seg.count,)
        key = (lead, tuple(cache.shape[2:]), cache.dtype, cache.device)
        with self._lock:
            free = self._free.get(key)
            if free:
                t = free.pop()
                self._bytes -= t.numel() * t.element_size()
                return t
        return _empty(cache, seg.kind, seg.count)

    def give(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        key = (tuple(t.shape[:-3]), tuple(t.shape[-3:]), t.dtype, t.device)
        with self._lock:
            if self._bytes + nbytes <= self._max_bytes:
                self._free.setdefault(key, []).append(t)
                self._bytes += nbytes


def layer_sources(
    cache: torch.Tensor, block_ids: list[int], segments: list[Segment], pool: StagingPool
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """(one contiguous tensor per segment, release): a run is a view of the cache, anything else a gathered
    copy. Call release() once the wire is done with the tensors, and only then."""
    sources, staged = [], []
    for seg in segments:
        ids = block_ids[seg.pos : seg.pos + seg.count]
        first = _as_run(ids) if seg.kind != BOTH else None
        if first is not None:
            sources.append(cache[seg.kind, first : first + seg.count])
        else:
            staged.append(gather(cache, ids, seg.kind, out=pool.take(cache, seg)))
            sources.append(staged[-1])
    sync_device(cache)

    def release() -> None:
        for t in staged:
            pool.give(t)

    return sources, release


def layer_sinks(
    cache: torch.Tensor, block_ids: list[int], segments: list[Segment], pool: StagingPool, refused: bool
) -> tuple[list[torch.Tensor], Callable[[], int]]:
    """(one buffer per segment to receive into, complete): a run lands in the cache directly, anything else
    in staging. complete() scatters the staging into the cache and returns the bytes written. A refused
    layer is drained into staging and complete() writes nothing: the sender has posted its sends already."""
    buffers, scatters = [], []
    for seg in segments:
        ids = block_ids[seg.pos : seg.pos + seg.count]
        first = _as_run(ids) if seg.kind != BOTH and not refused else None
        if first is not None:
            buffers.append(cache[seg.kind, first : first + seg.count])
        else:
            buffers.append(pool.take(cache, seg))
            scatters.append((ids, seg.kind, buffers[-1]))

    def complete() -> int:
        if not refused:
            for ids, kind, staging in scatters:
                scatter(cache, ids, kind, staging)
            sync_device(cache)  # done before the staging is reused and before anyone reads the cache
        for _, _, staging in scatters:
            pool.give(staging)
        return 0 if refused else sum(b.numel() * b.element_size() for b in buffers)

    return buffers, complete


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: neither numpy nor __cuda_array_interface__ know bfloat16, bytes always work."""
    return t.reshape(-1).view(torch.uint8)


def wire_buffer(t: torch.Tensor) -> object:
    """An object ucxx accepts: numpy for host memory, the tensor itself (__cuda_array_interface__) on CUDA."""
    flat = as_bytes(t)
    return flat if flat.is_cuda else flat.numpy()


def ready_event(cache: torch.Tensor) -> torch.cuda.Event | None:
    """On CUDA the layer's KV is only enqueued when send_blocks is called: mark the point to wait for."""
    if not cache.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cache.device))
    return event


def sync_device(t: torch.Tensor) -> None:
    """UCX and stream-less readers see memory, not streams: finish the copies we queued on this thread."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
