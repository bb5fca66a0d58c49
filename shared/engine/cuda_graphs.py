"""CUDA graphs for decode steps: the model's forward captured once per batch size of a ladder, then replayed.

A decode step of a small model launches hundreds of kernels (a dozen per layer), each from Python: on a GPU that
launch overhead, not the memory traffic, sets the step time. A graph replays them all with one launch.

What a graph captures is fixed: the kernels, their grids and the addresses of their inputs. So the inputs live
in static buffers (token ids, positions, slots, context lengths, block tables as wide as the longest context),
each step copies its values in, and a batch of n rows replays the smallest captured size >= n: the padded rows
carry slot -1 (the K/V write skips them) and a context of one token, and their outputs are not read. Only the
attention backend's decode path runs inside (the triton backend's reads nothing from the host: `graph_safe`).
Prefill and mixed steps, steps with LoRA rows, image features or KV sends run eagerly.

The ladder is vLLM's: 1, 2, 4, then every multiple of 8 up to the engine's max_num_seqs. All graphs share one
memory pool (captured largest first), so they cost the activations of the largest once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvrelay.engine.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # a padded row's K/V goes nowhere


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs."""
    sizes = [1, 2, 4]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8 if sizes[-1] >= 8 else 8)
    return sizes


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden]: the forward's output, rewritten by each replay


class DecodeGraphs:
    """Captured decode forwards of `model` over `kv_caches`, for batches of up to max(sizes) rows whose contexts
    fit in `max_blocks` blocks of `block_size`."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], sizes: list[int], max_blocks: int,
                 block_size: int) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = sorted(sizes)
        device = kv_caches[0].device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Captured] = {}

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def _meta(self, size: int) -> AttentionMetadata:
        ones = [1] * size
        return AttentionMetadata(
            num_reqs=size, num_decodes=size, num_decode_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            query_lens_cpu=ones, seq_lens_cpu=ones,  # not read inside a graph (graph_safe backends)
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size))

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (the largest first, so the others fit in its memory); seconds it took."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: kernels compiled and autotuned outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self._graphs[size] = _Captured(graph, hidden)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs for decode batches of %s rows in %.1f s", self.sizes, seconds)
        return seconds

    def size_for(self, rows: int, meta: AttentionMetadata) -> int | None:
        """The captured size a decode-only step of `rows` rows replays, or None when it must run eagerly."""
        if meta.num_decodes != meta.num_reqs or meta.block_tables.shape[1] > self.max_blocks:
            return None
        return next((s for s in self.sizes if s >= rows and s in self._graphs), None)

    def replay(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The forward's output rows of a decode-only step (valid until the next replay)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < size:  # rows a previous, larger step left: written nowhere, attending to one token
            self.slot_mapping[n:size].fill_(PAD_SLOT)
            self.seq_lens[n:size].fill_(1)
        captured = self._graphs[size]
        captured.graph.replay()
        return captured.hidden[:n]
