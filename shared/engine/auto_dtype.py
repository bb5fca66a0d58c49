"""What `--dtype auto` means on this machine, decided once per process and logged with the reason.

- `KVRELAY_AUTO_DTYPE=float32|bfloat16` in the environment wins (the test suite runs both ways with it, so
  a machine of either kind can check what the other kind would do).
- CUDA: bfloat16.
- CPU without native bf16 matmul (no AVX512-BF16 or AMX; torch's mkldnn says so): float32. bf16 GEMMs are
  emulated there and run many times slower.
- CPU with AMX: bfloat16 (its tile units only speed up bf16/int8).
- CPU with AVX512-BF16 but no AMX: measured. Such machines go either way: fp32 GEMMs ran faster than bf16
  on one Xeon, bf16 faster on AMD EPYCs (docs/results/2026-11-24-zen4/NOTES.md). So the engine times both at
  its own shapes, picks the faster, and caches the verdict per CPU model, torch version and thread count.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "KVRELAY_AUTO_DTYPE"
_CHOICES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.cache
def auto_dtype(device_type: str) -> torch.dtype:
    forced = os.environ.get(ENV)
    if forced:
        if forced not in _CHOICES:
            raise ValueError(f"{ENV}={forced!r}: choose float32 or bfloat16")
        logger.info("dtype auto -> %s (forced by %s)", forced, ENV)
        return _CHOICES[forced]
    if device_type == "cuda":
        return torch.bfloat16
    dtype, reason = _cpu_choice()
    logger.info("dtype auto -> %s on this CPU: %s", str(dtype).removeprefix("torch."), reason)
    return dtype


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo, or None off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown"


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ... ("unknown" where /proc/cpuinfo does not say)."""
    return _cpuinfo("vendor_id") or "unknown"


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cpu_choice() -> tuple[torch.dtype, str]:
    if not _native_bf16():
        return torch.float32, "no native bf16 matmul (no AVX512-BF16/AMX): bf16 would be emulated"
    if "amx_bf16" in cpu_flags():
        return torch.bfloat16, "AMX bf16 tiles"
    rates = _cached_rates()
    faster = "bfloat16" if rates["bfloat16"] > rates["float32"] else "float32"
    reason = (f"AVX512-BF16 without AMX: measured GEMM {rates['float32']:.0f} GFLOP/s fp32 vs "
              f"{rates['bfloat16']:.0f} bf16 on {torch.get_num_threads()} threads")
    return _CHOICES[faster], reason


def gemm_gflops(dtype: torch.dtype, m: int = 512, k: int = 576, n: int = 1536, seconds: float = 0.25) -> float:
    """Best GFLOP/s of an [m, k] x [k, n] matmul (the shape of a small model's projections at a busy step)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        torch.matmul(a, b)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def _cached_rates() -> dict[str, float]:
    key = f"{cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    base = os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvrelay")
    path = Path(base) / "auto_dtype.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = {name: gemm_gflops(dt) for name, dt in _CHOICES.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home only costs a re-measure next start
    return cache[key]
