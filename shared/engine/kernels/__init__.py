"""Native CPU kernels, compiled once per machine with torch's C++ extension builder and cached.

    paged_attention  a step's attention (decodes and prefill chunks) reading K/V in place through the block
                     table (fp32/bf16 q; fp32, bf16, fp8 or int8 cache; AVX512-BF16 dot products where the CPU has them)
    add_rms_norm     residual add + RMSNorm in one pass
    silu_mul         SiLU(gate) * up in one pass
    rope_write_kv    rotary embedding of q and k in place + the KV-cache write, in one pass
    lora_add         the low-rank update of a batch whose rows use different LoRA adapters (or none), in one call
    gguf_gemm        a linear layer on weights kept in GGUF's Q4_0/Q4_1/Q8_0 blocks (int8 activations, as llama.cpp)
    gguf_decoder_layers  every decoder layer of a Llama-family model on such blocks in one call (no Python between)

The build happens on first use (about a minute on 2 cores) under torch's own file lock, so concurrent node
processes wait for one build; the sources' content keys the build folder, so an edited kernel is rebuilt.
Any failure leaves `load()` returning None and the portable torch path in use.
`python -m kvrelay.engine.kernels` builds them now (`make install` does, so no request waits for it).
`KVRELAY_KERNEL_MARCH` (default `native`) builds for another CPU level, e.g. `x86-64-v3` (AVX2, no AVX512), so
an AVX512 machine can test the code paths an AVX2-only machine runs. `KVRELAY_KV_PREFETCH` (`l1` or `l2`; default
`l2` on AMD CPUs, `l1` elsewhere) says which cache the attention kernels ask KV rows into (csrc/common.h; AMD
cores before Zen 4 fill L1 whatever the hint).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "paged_decode.cpp", "paged_decode_amx.cpp", "paged_prefill.cpp",
            "paged_prefill_amx.cpp", "fused_ops.cpp", "skinny_linear.cpp", "small_gemm.cpp", "lora.cpp",
            "gguf_gemm.cpp", "gguf_stack.cpp")
_lock = threading.Lock()
_module = None
_tried = False


def _build_dir() -> Path:
    import torch

    base = os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvrelay"
    )
    # Keyed by the sources' content and place: torch's build files name the sources by path, so two
    # checkouts sharing one folder would keep rebuilding over each other.
    digest = hashlib.sha256(str(_CSRC.resolve()).encode())
    for path in sorted(_CSRC.iterdir()):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(_march().encode())
    digest.update(" ".join(_defines()).encode())
    tag = f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:16]}"
    path = Path(base) / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(build_dir: Path):
    """The build folder to this process alone, with torch's own lock file cleared if one was left behind.

    Every load takes torch's lock (a file it creates, and deletes when done) to check the build, and waits for as
    long as the file exists: a process killed meanwhile (a node stopped with SIGKILL while it started) left it
    there, and every later start hung. An flock, which the OS drops when its holder dies, now admits one loader
    at a time; whoever holds it knows a torch lock file in the folder is stale.
    """
    with open(build_dir / "load.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


def _march() -> str:
    return os.environ.get("KVRELAY_KERNEL_MARCH") or "native"


def kv_prefetch_target() -> str:
    """`l1` or `l2`: the cache KV rows are prefetched into (measured per kind of machine, csrc/common.h)."""
    chosen = os.environ.get("KVRELAY_KV_PREFETCH")
    if chosen:
        if chosen not in ("l1", "l2"):
            raise ValueError(f"KVRELAY_KV_PREFETCH={chosen!r}: choose l1 or l2")
        return chosen
    from kvrelay.engine.auto_dtype import cpu_vendor

    return "l2" if cpu_vendor() == "AuthenticAMD" else "l1"


def _defines() -> list[str]:
    return ["-DKVRELAY_PREFETCH_L2"] if kv_prefetch_target() == "l2" else []


def load():
    """The compiled module, or None when it cannot be built here (or KVRELAY_DISABLE_CPU_KERNELS is set)."""
    global _module, _tried
    if _tried:  # every linear layer asks: no lock, no environment lookup once decided
        return _module
    if os.environ.get("KVRELAY_DISABLE_CPU_KERNELS"):
        return None
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import load as build

            logger.info("loading the native CPU kernels (compiled once per machine; KV rows prefetched into %s)",
                        kv_prefetch_target().upper())
            build_dir = _build_dir()
            with _exclusive(build_dir):
                _module = build(
                    name="kvrelay_cpu_kernels",
                    sources=[str(_CSRC / name) for name in _SOURCES],
                    extra_cflags=["-O3", f"-march={_march()}", "-fno-math-errno", "-fopenmp", *_defines()],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as e:  # a missing compiler must not stop serving
            logger.warning("native CPU kernels unavailable (%s); using the torch path", e)
            _module = None
        return _module

