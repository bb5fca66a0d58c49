"""AWQ, GPTQ and FP8 checkpoints (`--quantization awq|gptq|fp8`, or read from config.json: engine/quant_config.py),
kept quantized in memory and dequantized on the fly, one tile of output rows at a time: the dense weight never
exists whole, and nothing is dequantized at load.

Layouts as the checkpoints store them (safetensors, per projection `<module>.<tensor>`):
- AWQ (AutoAWQ, gemm): `qweight` int32 [in, out / 8], eight 4-bit weights per word, output columns in the order
  0, 2, 4, 6, 1, 3, 5, 7 from the low bits up; `qzeros` int32 [groups, out / 8], packed the same way; `scales`
  [groups, out]. w = (q - z) * s, groups along the input.
- GPTQ (AutoGPTQ): `qweight` int32 [in * bits / 32, out], consecutive input rows from the low bits up; `qzeros`
  int32 [groups, out * bits / 32], consecutive output columns from the low bits up, each zero minus one in the
  v1 format; `scales` [groups, out]; `g_idx` [in], the group of each input channel (act-order permutes them).
- FP8: `weight` float8_e4m3fn [out, in] with `weight_scale` (one, or one per output row) or, with
  weight_block_size, `weight_scale_inv` [ceil(out / bo), ceil(in / bi)]; w = weight * scale. `input_scale`
  (a static activation scale) is not needed: activations stay in the compute dtype.

In memory, 4-bit weights are two to a byte (uint8 [out, in / 2]), 8-bit ones a byte each, with fp32 scales and
zero points per (output row, group). No native kernel runs these formats yet: this is the correct path for
loading and checking such checkpoints, not a fast one (README: quantization).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kvrelay.engine.quant_config import QuantConfigError, QuantSpec

from .llama import FusedLinear, Linear
from .weight_targets import copy_into, projection_owners, weight_targets

logger = logging.getLogger(__name__)

_TILE_ROWS = 512  # output rows dequantized at once (512 x 4096 fp32: 8 MiB)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column held by each 4-bit slot of an AWQ word, low bits first
_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "input_scale")


class TiledWeight(ABC):
    """A [rows, cols] weight that dequantizes `tile(start, stop)` (fp32 rows) on demand."""

    rows: int
    cols: int

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held (the quantized values and their scales)."""

    @abstractmethod
    def tile(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) in fp32."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + bias, in x's dtype (computed in fp32)."""
        shape, x32 = x.shape, x.reshape(-1, self.cols).float()
        parts = [F.linear(x32, self.tile(start, min(start + _TILE_ROWS, self.rows)),
                          None if bias is None else bias[start : start + _TILE_ROWS].float())
                 for start in range(0, self.rows, _TILE_ROWS)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return y.to(x.dtype).reshape(*shape[:-1], self.rows)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in fp32 (for tests and references only)."""
        return self.tile(0, self.rows)


@dataclass
class GroupIntWeight(TiledWeight):
    """Integer weights with a scale and zero point per (output row, input group): w = (q - zero) * scale."""

    packed: torch.Tensor  # uint8 [rows, cols / 2] (4-bit, low nibble first) or [rows, cols] (8-bit)
    scales: torch.Tensor  # fp32 [rows, groups]
    zeros: torch.Tensor  # fp32 [rows, groups]
    group_of: torch.Tensor  # int64 [cols]: each input channel's group
    bits: int
    cols: int

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 4 * (self.scales.numel() + self.zeros.numel())

    def tile(self, start: int, stop: int) -> torch.Tensor:
        p = self.packed[start:stop]
        q = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(stop - start, self.cols) if self.bits == 4 else p
        g = self.group_of
        return (q.float() - self.zeros[start:stop][:, g]) * self.scales[start:stop][:, g]


@dataclass
class Fp8Weight(TiledWeight):
    """e4m3 weights times a scale per tensor, per output row, or per (row block, column block)."""

    weight: torch.Tensor  # float8_e4m3fn [rows, cols]
    scale: torch.Tensor  # fp32 [1, 1], [rows, 1] or [row blocks, column blocks]
    block: tuple[int, int] | None

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.weight.shape[0]

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def tile(self, start: int, stop: int) -> torch.Tensor:
        w = self.weight[start:stop].float()
        if self.block is None:
            return w * (self.scale if self.scale.shape[0] == 1 else self.scale[start:stop])
        bo, bi = self.block
        rows = torch.arange(start, stop) // bo
        s = self.scale[rows].repeat_interleave(bi, dim=1)[:, : self.cols]
        return w * s


@dataclass
class StackedWeight(TiledWeight):
    """Shards stacked along the output rows (a fused q|k|v or gate|up), each quantized on its own."""

    parts: list[TiledWeight]

    @property
    def rows(self) -> int:  # type: ignore[override]
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p.linear(x) for p in self.parts], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    def tile(self, start: int, stop: int) -> torch.Tensor:
        out, offset = [], 0
        for p in self.parts:
            lo, hi = max(start, offset), min(stop, offset + p.rows)
            if lo < hi:
                out.append(p.tile(lo - offset, hi - offset))
            offset += p.rows
        return torch.cat(out)


# ------------------------------------------------------------------------------------------------ layouts


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values, low bits first, as a new last dimension."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [rows, cols] values of `bits` bits -> our uint8 layout (4-bit: two per byte, low nibble first)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if bits == 4 else q.contiguous()


def _group_of(cols: int, group_size: int) -> torch.Tensor:
    return torch.arange(cols) // (cols if group_size == -1 else group_size)


def awq_weight(t: dict[str, torch.Tensor], spec: QuantSpec, name: str) -> GroupIntWeight:
    qweight, qzeros, scales = _need(t, name, "qweight", "qzeros", "scales")
    cols, rows = qweight.shape[0], qweight.shape[1] * 8
    order = torch.tensor(_AWQ_ORDER)

    def columns(words: torch.Tensor) -> torch.Tensor:  # [n, out / 8] words -> [n, out] values
        slots = _unpack_words(words, 4)
        return torch.empty_like(slots).index_copy_(-1, order, slots).reshape(words.shape[0], -1)

    q, z = columns(qweight), columns(qzeros)
    _check_groups(name, cols, spec.group_size, scales.shape[0], z.shape[0])
    _check_rows(name, rows, scales)
    return GroupIntWeight(_pack_rows(q.t(), 4), scales.float().t().contiguous(), z.float().t().contiguous(),
                          _group_of(cols, spec.group_size), 4, cols)


def gptq_weight(t: dict[str, torch.Tensor], spec: QuantSpec, name: str) -> GroupIntWeight:
    qweight, qzeros, scales = _need(t, name, "qweight", "qzeros", "scales")
    per = 32 // spec.bits
    cols, rows = qweight.shape[0] * per, qweight.shape[1]
    q = _unpack_words(qweight.t(), spec.bits).reshape(rows, cols)  # word r holds input rows r * per + j
    z = _unpack_words(qzeros, spec.bits).reshape(qzeros.shape[0], -1)[:, :rows].float()
    if spec.zeros_minus_one:
        z = z + 1
    _check_groups(name, cols, spec.group_size, scales.shape[0], z.shape[0])
    _check_rows(name, rows, scales)
    g_idx = t.get("g_idx")
    group_of = g_idx.long() if g_idx is not None else _group_of(cols, spec.group_size)
    if group_of.shape != (cols,) or int(group_of.min()) < 0 or int(group_of.max()) >= scales.shape[0]:
        raise QuantConfigError(f"{name}.g_idx: not one group in [0, {scales.shape[0]}) per input channel")
    return GroupIntWeight(_pack_rows(q, spec.bits), scales.float().t().contiguous(), z.t().contiguous(), group_of,
                          spec.bits, cols)


def fp8_weight(t: dict[str, torch.Tensor], spec: QuantSpec, name: str) -> Fp8Weight:
    weight = t.get("weight")
    if weight is None or weight.dtype != torch.float8_e4m3fn:
        raise QuantConfigError(f"{name}.weight: an fp8 checkpoint's weights are float8_e4m3fn")
    rows, cols = weight.shape
    if spec.weight_block_size is not None:
        (scale,) = _need(t, name, "weight_scale_inv")
        bo, bi = spec.weight_block_size
        if tuple(scale.shape) != (-(-rows // bo), -(-cols // bi)):
            raise QuantConfigError(f"{name}.weight_scale_inv: {tuple(scale.shape)} is not one scale per "
                                   f"{bo} x {bi} block of a {rows} x {cols} weight")
        return Fp8Weight(weight, scale.float(), spec.weight_block_size)
    (scale,) = _need(t, name, "weight_scale")
    if scale.numel() not in (1, rows):
        raise QuantConfigError(f"{name}.weight_scale: {scale.numel()} scales for {rows} rows (1 or one per row)")
    return Fp8Weight(weight, scale.float().reshape(-1, 1), None)


_BUILDERS = {"awq": awq_weight, "gptq": gptq_weight, "fp8": fp8_weight}


def _need(t: dict[str, torch.Tensor], name: str, *fields: str) -> list[torch.Tensor]:
    missing = [f for f in fields if f not in t]
    if missing:
        raise QuantConfigError(f"{name}: the checkpoint lacks {', '.join(f'{name}.{f}' for f in missing)}")
    return [t[f] for f in fields]


def _check_groups(name: str, cols: int, group_size: int, *counts: int) -> None:
    want = 1 if group_size == -1 else -(-cols // group_size)
    if group_size != -1 and cols % group_size:
        raise QuantConfigError(f"{name}: {cols} input channels are not whole groups of {group_size}")
    if any(c != want for c in counts):
        raise QuantConfigError(f"{name}: {counts} groups of scales and zeros, expected {want} "
                               f"({cols} inputs, group_size {group_size})")


def _check_rows(name: str, rows: int, scales: torch.Tensor) -> None:
    if scales.shape[-1] != rows:
        raise QuantConfigError(f"{name}.scales: {scales.shape[-1]} columns for {rows} output rows")


# ------------------------------------------------------------------------------------------------ loading


def load_quantized_weights(model: nn.Module, files: list[Path], spec: QuantSpec,
                           round_to: torch.dtype | None = None) -> None:
    """Place every tensor: a quantized projection's as its TiledWeight (a fused one's shards stacked), the rest
    dense, as the safetensors loader does. QuantConfigError names the tensor at fault."""
    targets, owners = weight_targets(model), projection_owners(model)
    tied = model.arch.tie_word_embeddings
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                prefix, _, field = key.rpartition(".")
                tensor = f.get_tensor(key)
                if field in _QUANT_SUFFIXES or (field == "weight" and tensor.dtype == torch.float8_e4m3fn):
                    quantized.setdefault(prefix, {})[field] = tensor
                elif tied and key == "lm_head.weight" or key.endswith("rotary_emb.inv_freq"):
                    continue
                elif key in targets:
                    param, rows = targets[key]
                    copy_into(param, rows, tensor if round_to is None else tensor.to(round_to), key)
                    loaded.add(key)
                else:
                    raise QuantConfigError(f"checkpoint tensor {key} is not part of this model")
    shards: dict[Linear, dict[str, TiledWeight]] = {}
    for prefix, tensors in quantized.items():
        if f"{prefix}.weight" not in owners:
            raise QuantConfigError(f"{prefix}: quantized, but not a projection of this model")
        module, shard = owners[f"{prefix}.weight"]
        shards.setdefault(module, {})[shard] = _BUILDERS[spec.method](tensors, spec, prefix)
        loaded.add(f"{prefix}.weight")
    for module, parts in shards.items():
        order = list(module.shards) if isinstance(module, FusedLinear) else list(parts)
        if set(parts) != set(order):
            raise QuantConfigError(f"{sorted(parts)}: a fused projection's shards must all be quantized "
                                   f"({', '.join(order)})")
        module.use_blocks(parts[order[0]] if len(order) == 1 else StackedWeight([parts[s] for s in order]))
    missing = sorted(set(targets) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise QuantConfigError(f"checkpoint lacks tensors the model needs: {missing[:8]} ({len(missing)} in all)")
    held = sum(w.nbytes for w in {id(m.blocks): m.blocks for m in shards}.values())
    logger.info("%s: %d projections kept quantized (%.1f MiB), dequantized per tile of %d rows", spec.method,
                len(shards), held / 2**20, _TILE_ROWS)
