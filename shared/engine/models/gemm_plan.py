"""Which kernel runs a bf16 linear layer on AMX past the small GEMM's fixed row limit: measured once per machine
and weight shape, and kept on disk.

Why measure: oneDNN's AMX GEMM runs some shapes on one thread, at half its rate, and which ones depends on the
row count in ways no rule we found predicts (the figures for SmolLM2 on an AMX Xeon are in
docs/results/2026-11-26-xeon-amx/NOTES.md). The small GEMM (small_gemm.cpp) keeps an even rate at every row
count, a multiple of 16 or not. So both kernels
are timed on the weight's shape for every bucket of BUCKET rows up to MAX_ROWS, at the bucket's top and at an
odd row count inside it (a step's token count rarely is a multiple of anything; best of a few calls each), and
oneDNN takes the bucket only where it is ODNN_MARGIN faster. The margin is what the timing leaves out: oneDNN
builds a primitive on its first call at each new row count, which in serving is nearly every mixed step, and
such a first call runs many times slower than the next.
The verdict is cached per CPU model, torch version, thread count and shape under a file lock (as auto_dtype
caches its verdict), so every process on a machine (a fleet's nodes, the colocated engine they are checked
against) runs the same kernel at the same row count and computes the same numbers.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from kvrelay.common.system import cache_dir
from kvrelay.engine.auto_dtype import cpu_model

logger = logging.getLogger(__name__)

BUCKET = 64
MAX_ROWS = 2048  # a step's default token budget; past it oneDNN runs every call
ODD_BELOW_TOP = 21  # the second row count timed in a bucket: top - 21, odd and not a multiple of 16
ODNN_MARGIN = 0.95  # oneDNN's time must be below this fraction of the small GEMM's to take a bucket
CACHE_FILE = "gemm_plan.json"
VERSION = 2  # in the cache key; version 2 also times an odd row count and adds the margin


@dataclass(frozen=True)
class RowPlan:
    """For rows in (first, first + BUCKET * len(small)]: whether the small GEMM takes them, per bucket."""

    first: int
    small: tuple[bool, ...]

    def takes_small(self, rows: int) -> bool:
        bucket = (rows - self.first - 1) // BUCKET
        return 0 <= bucket < len(self.small) and self.small[bucket]


def _best_seconds(fn, calls: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(out_features: int, in_features: int, first: int, module) -> list[bool]:
    """Per bucket above `first` rows: whether the small GEMM ran at least as fast as oneDNN."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    small = module.pack_small_gemm(weight)
    verdict = []
    for top in range(first + BUCKET, MAX_ROWS + 1, BUCKET):
        t_small = t_onednn = 0.0
        for rows in (top, top - ODD_BELOW_TOP):
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            t_small += _best_seconds(lambda x=x: module.small_gemm(x, small, out_features, None))
            t_onednn += _best_seconds(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
        verdict.append(small_wins(t_small, t_onednn))
    return verdict


def small_wins(t_small: float, t_onednn: float) -> bool:
    """Whether the small GEMM takes a bucket: unless oneDNN is clearly faster (ODNN_MARGIN), as near-ties go to
    the kernel with no primitive to build and whose rows do not depend on their batch."""
    return t_onednn >= ODNN_MARGIN * t_small


@functools.cache
def plan(out_features: int, in_features: int, first: int, module) -> RowPlan:
    """The measured plan for a bf16 weight [out_features, in_features] above `first` rows (cached on disk)."""
    key = (f"v{VERSION}|{cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads|"
           f"bf16 {out_features}x{in_features} above {first} by {BUCKET} to {MAX_ROWS}")
    path = cache_dir() / CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others wait and read its verdict
            try:
                cache = json.loads(path.read_text())
            except (OSError, ValueError):
                cache = {}
            if key not in cache:
                cache[key] = _measure_logged(out_features, in_features, first, module)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(cache, indent=1))
                tmp.replace(path)
            verdict = cache[key]
    except OSError as e:  # no writable cache: this process measures for itself
        logger.warning("GEMM plan cache unusable (%s); measuring in this process only", e)
        verdict = _measure_logged(out_features, in_features, first, module)
    return RowPlan(first, tuple(bool(v) for v in verdict))


def _measure_logged(out_features: int, in_features: int, first: int, module) -> list[bool]:
    t0 = time.perf_counter()
    verdict = _measure(out_features, in_features, first, module)
    logger.info("GEMM plan for bf16 [%d x %d]: the small GEMM takes %d of %d row buckets above %d (measured in "
                "%.1f s, cached)", out_features, in_features, sum(verdict), len(verdict), first,
                time.perf_counter() - t0)
    return verdict
