"""The elementwise work around a layer's GEMMs, done by fused native kernels on CPU when they are built
(kvrelay.engine.kernels), else by the equivalent torch ops. Both give the same results (see the kernels'
notes on rounding); the fused ones make one pass over memory instead of three to six.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerOps:
    """Portable torch versions."""

    native = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # One fused torch op (statistics in fp32) instead of HF's five; it matched HF exactly in fp32 when
        # measured, and is within rounding in bf16 (HF rounds before scaling by the weight).
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (in place), then (rms_norm(residual) * weight, residual); without a residual, x is it."""
        if residual is None:
            return self.rms_norm(x, weight, eps), x
        residual.add_(x)
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        size = gate_up.shape[-1] // 2
        x = F.silu(gate_up[:, :size])
        return x.mul_(gate_up[:, size:])

    def rope_prepare(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Once per forward: what every layer's rope_ needs (cos/sin tables are [max_pos, d/2])."""
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rope_(self, qk: torch.Tensor, prepared: tuple) -> None:
        """Rotate qk [T, heads, d] in place (neox halves): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
        c, s = prepared
        x1, x2 = qk.chunk(2, dim=-1)
        rotated1 = torch.addcmul(x1 * c, x2, s, value=-1.0)
        x2.mul_(c).addcmul_(x1, s)
        x1.copy_(rotated1)


class NativeLayerOps(LayerOps):
    """The fused CPU kernels; falls back to torch for what they do not take (e.g. non-contiguous rows)."""

    native = True

    def __init__(self, kernels) -> None:
        self._k = kernels

    def add_rms_norm(self, x, residual, weight, eps):
        if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
            return super().add_rms_norm(x, residual, weight, eps)
        out, residual = self._k.add_rms_norm(x, residual, weight, eps)
        return out, residual

    def silu_mul(self, gate_up):
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.device.type != "cpu":
            return super().silu_mul(gate_up)
        return self._k.silu_mul(gate_up)

    def rope_prepare(self, cos, sin, positions):
        return cos, sin, positions

    def rope_(self, qk, prepared):
        cos, sin, positions = prepared
        if qk.device.type != "cpu" or qk.stride(2) != 1 or qk.stride(1) != qk.shape[2]:
            return super().rope_(qk, super().rope_prepare(cos, sin, positions))
        self._k.rope_write_kv(qk, qk[:, :0], cos, sin, positions, None, None, qk.shape[1])


def layer_ops(device: torch.device) -> LayerOps:
    """The fused kernels on CPU when they can be built here, else the torch ops."""
    if torch.device(device).type == "cpu":
        from kvrelay.engine import kernels

        native = kernels.load()
        if native is not None and hasattr(native, "add_rms_norm"):
            return NativeLayerOps(native)
    return LayerOps()
