"""Small native helpers, compiled once per machine with the system C compiler and cached.

`shared/common/csrc/kvrelay_native.c` is a plain CPython extension (no torch headers, builds in about a second):

- `hash_chain`: a prompt's chained block hashes in one call (kvrelay.common.hashing). The gateway hashes every
  prompt, and in Python the per-block loop and the list-to-int32 conversion dominate a routing decision.
  The hash itself stays the `xxhash` package's own XXH3_128bits, called through its exported symbol, so
  the bytes are the contract's by construction.
- `copy_blocks`: a gather/scatter copy of equal-sized blocks in one pass, without the GIL (kv_transfer's
  same-host connector). numpy's fancy indexing makes two passes (gather into a temporary, then scatter).

Build: on first use, under a file lock (concurrent processes wait for one build), into
<kvrelay cache>/native/<source digest>/. `python -m kvrelay.common.native` builds it ahead (make install does). Any
failure (no compiler, no Python headers) leaves `load()` returning None and the callers on their portable
Python/numpy paths, which compute the same results.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "kvrelay_native.c"
_NAME = "kvrelay_native"
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _build_dir() -> Path:
    from kvrelay.common.system import cache_dir

    digest = hashlib.sha256(_SRC.read_bytes()).hexdigest()[:16]
    abi = sysconfig.get_config_var("SOABI") or "abi"
    return cache_dir() / "native" / f"{abi}-{digest}"


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise RuntimeError(f"no Python.h in {include} (install the Python development headers)")
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(_SRC), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, out)  # published whole, or not at all


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _xxh3_128_address() -> int:
    import xxhash._xxhash as ext

    return ctypes.cast(ctypes.CDLL(ext.__file__).XXH3_128bits, ctypes.c_void_p).value


def _build_and_load() -> ModuleType:
    folder = _build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not path.is_file():
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
            if not path.is_file():
                logger.info("compiling %s (once per machine)", _SRC.name)
                _compile(path)
    module = _import(path)
    module.set_xxh3_128(_xxh3_128_address())
    return module


def load() -> ModuleType | None:
    """The compiled helpers, or None when they cannot be built here (KVRELAY_DISABLE_NATIVE=1: always None)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if not os.environ.get("KVRELAY_DISABLE_NATIVE"):
            try:
                _module = _build_and_load()
            except Exception as e:  # a missing compiler must not stop anything: the callers fall back
                logger.warning("native helpers unavailable (%s); using the portable paths", e)
        _tried = True
        return _module


if __name__ == "__main__":
    # `python -m kvrelay.common.native`: build now (make install does), so that no request waits for it.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load() is not None else 1)
