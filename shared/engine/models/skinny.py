"""Matmuls of a few rows (decodes, speculative verification) through a native CPU kernel that streams the
weight once per 8 rows (csrc/skinny_linear.cpp), built once per machine like the attention kernel.

A general GEMM costs several times a matrix-vector product for 2..16 rows on CPU, which would make verifying
k drafts cost nearly k decode steps. The kernel's result for a row does not depend on the other rows of the
batch, so a decode's logits are bit-identical alone, batched, or verified with drafts beside it. Anything it
cannot take (other dtypes or devices, more than MAX_ROWS rows, no compiler) goes to torch.nn.functional.linear.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 32  # beyond this a GEMM's blocking wins
_SRC = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
_lock = threading.Lock()
_module = None
_tried = False


def _load():
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            if os.environ.get("KVRELAY_DISABLE_CPU_KERNELS"):
                return None
            from torch.utils.cpp_extension import load as build

            base = os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
                os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvrelay")
            st = _SRC.stat()
            tag = f"torch{torch.__version__.replace('+', '_')}-skinny-{int(st.st_mtime)}-{st.st_size}"
            path = Path(base) / "kernels" / tag
            path.mkdir(parents=True, exist_ok=True)
            logger.info("loading the native CPU skinny-matmul kernel (compiled once per machine)")
            _module = build(name="kvrelay_skinny_linear", sources=[str(_SRC)], build_directory=str(path),
                            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                            verbose=False)
        except Exception as e:  # a missing compiler must not stop serving
            logger.warning("native skinny-matmul kernel unavailable (%s); using torch's matmul", e)
            _module = None
        finally:
            _tried = True
        return _module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous()):
        module = _load()
        if module is not None:
            return module.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
