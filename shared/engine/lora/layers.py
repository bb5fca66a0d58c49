"""The LoRA side of one projection: its adapters' weights stacked by slot, and the update of a batch of rows that
use different adapters (or none).

A projection of the model (`Linear`, or a fused q|k|v or gate|up) gets a `LoRAProjection` when LoRA is on:
`a` [slots, S*R, in] stacks the S shards' A matrices (rank padded to R = max_lora_rank with zeros) and `bt`
[slots, R, out] their B matrices transposed, side by side as the shards' output columns are. After the base
matmul, `add(y, x, batch)` adds B (A x) for each row with a slot, in one native call for the whole batch
(kernels/csrc/lora.cpp) where the kernels are built, else `lora_add_reference`, the portable torch version and
the reference the kernel is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.engine import kernels


@dataclass(frozen=True)
class LoRABatch:
    """A step's rows' adapter slots (int32, -1: the base model), in the flat batch's row order."""

    slots: torch.Tensor

    def rows(self, start: int, stop: int) -> LoRABatch:
        """The slots of rows [start, stop) (an MLP that runs many rows in chunks)."""
        return LoRABatch(self.slots[start:stop])


class LoRAProjection:
    """Slots of one projection. `shards`: per HF module name, its (first output column, size), in order."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shards = dict(shards)
        self.rank = max_rank
        out = sum(size for _, size in shards.values())
        self.a = torch.zeros(num_slots, len(shards) * max_rank, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device)
        self.shard_cols = [0, *(start + size for start, size in shards.values())]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these (A [r, in], B [out, r]) per shard name; shards without weights get zeros."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for i, (name, (start, size)) in enumerate(self.shards.items()):
            pair = weights.get(name)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, i * self.rank : i * self.rank + r].copy_(a)
            self.bt[slot, :r, start : start + size].copy_(b.t())

    def add(self, y: torch.Tensor, x: torch.Tensor, batch: LoRABatch) -> None:
        """y += B[slot] A[slot] x for each row of x with a slot >= 0, in place."""
        native = kernels.load() if x.device.type == "cpu" else None
        if native is not None and hasattr(native, "lora_add") and x.dtype in (torch.float32, torch.bfloat16):
            native.lora_add(y, x.contiguous(), self.a, self.bt, batch.slots, self.shard_cols)
        else:
            lora_add_reference(y, x, self.a, self.bt, batch.slots, self.shard_cols)


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
                       shard_cols: Sequence[int]) -> None:
    """The portable version of the native lora_add: y[t] += B[s] (A[s] x[t]) for rows t with slot s >= 0, shard
    by shard (shard i: rank rows [i R, (i + 1) R) of A, output columns shard_cols[i] .. shard_cols[i + 1])."""
    rank = bt.shape[1]
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().flatten()
        buf = x[rows].float() @ a[s].float().t()  # [n, S * R]
        for i in range(len(shard_cols) - 1):
            c0, c1 = shard_cols[i], shard_cols[i + 1]
            delta = buf[:, i * rank : (i + 1) * rank] @ bt[s, :, c0:c1].float()
            y[rows, c0:c1] = (y[rows, c0:c1].float() + delta).to(y.dtype)
