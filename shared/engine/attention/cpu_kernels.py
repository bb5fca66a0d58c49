"""Native CPU kernels, compiled once per machine with torch's C++ extension builder and cached.

The build happens on first use (about a minute on 2 cores) under torch's own file lock, so concurrent node
processes wait for one build. Any failure leaves `load()` returning None and the portable torch path in use.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()
_module = None
_tried = False


def _build_dir() -> Path:
    import torch

    base = os.environ.get("KVRELAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvrelay"
    )
    # The source's mtime and size key the folder, so an edited kernel is rebuilt.
    st = _SRC.stat()
    tag = f"torch{torch.__version__.replace('+', '_')}-{int(st.st_mtime)}-{st.st_size}"
    path = Path(base) / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def load():
    """The compiled module (with `paged_decode`), or None when it cannot be built here."""
    global _module, _tried
    if os.environ.get("KVRELAY_DISABLE_CPU_KERNELS"):
        return None
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import load as build

            logger.info("loading the native CPU attention kernel (compiled once per machine)")
            _module = build(
                name="kvrelay_paged_decode",
                sources=[str(_SRC)],
                extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir()),
                verbose=False,
            )
        except Exception as e:  # a missing compiler must not stop serving
            logger.warning("native CPU attention kernel unavailable (%s); using the torch path", e)
            _module = None
        return _module


if __name__ == "__main__":
    # `python -m shared.engine.attention.cpu_kernels`: build now (make install does), so no request waits for it.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load() is not None else 1)
