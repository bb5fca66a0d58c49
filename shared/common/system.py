"""Operating-system helpers the launchers, nodes and tests share: free ports, advertised host names,
children that die with their parent, a heap that keeps what it frees, huge pages for large tensors, and the
cores a process may run on."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
from pathlib import Path

_handed_out: set[int] = set()

# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_CHUNKS_BELOW = 32 << 20  # glibc's largest mmap threshold (half its 64 MiB heap)
KEEP_FREE_TOP = 1 << 30
TORCH_THP_ENV = "THP_MEM_ALLOC_ENABLE"  # PyTorch's switch for THP-advised CPU allocations of 2 MiB and more
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    return host in ("127.0.0.1", "localhost", "::1")


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity, which a cgroup or taskset narrows), in order."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def parse_cores(text: str) -> tuple[int, ...]:
    """A core list as taskset and cgroups write it ("0-3,8,10-11") as sorted core numbers; ValueError if malformed."""
    cores: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"{text!r} is not a core list (like 0-3,8)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part.strip()!r} in {text!r} is not a range of core numbers")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cores(cores: tuple[int, ...]) -> str:
    """The short form of a core list: (0, 1, 2, 5) -> "0-2,5"."""
    parts, run = [], []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, for a server that binds it later (possibly seconds later).

    It is drawn below the kernel's ephemeral range: a port the kernel assigns itself (the source port of an
    outgoing connection, a listener on port 0) can then never take it between this pick and the bind, which a
    port from `bind(0)` cannot promise. No port is handed out twice by one process.
    """
    low, _ = _ephemeral_range()
    start = 20000 if low > 21000 else 1024
    rng = random.SystemRandom()
    for _ in range(200 if low - start >= 64 else 0):
        port = rng.randrange(start, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded range: fall back to the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised(host: str) -> str:
    """The address others reach a wildcard bind on."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def die_with_parent() -> None:
    """In a child (preexec_fn): SIGTERM it when the parent dies without cleaning up (e.g. SIGKILL).

    Linux only. The signal fires when the *thread* that started the child exits, so start children from a
    long-lived thread (the main thread in practice).
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def keep_freed_memory() -> bool:
    """glibc only: keep freed memory in the heap for the next allocation rather than handing it back.

    A CPU forward pass allocates and frees tens of MiB of activations per layer. By default glibc returns
    such chunks to the kernel (mmap'd chunks on free, the heap's top past its trim threshold), so the next step
    page-faults the same memory back in, zeroed by the kernel: a 2048-token bf16 prefill spent 20% of its time
    there (sys time, 300K minor faults per 20K tokens). vLLM gets the same effect from preloading tcmalloc.
    Returns whether the setting took (False off glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_CHUNKS_BELOW)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_TOP))


def release_freed_memory() -> bool:
    """glibc only: hand back to the kernel the memory freed so far that the heap keeps (`malloc_trim`): the main
    heap's free top, and the whole free pages inside every arena's heaps.

    The other side of `keep_freed_memory`: a process that builds engine after engine on different threads (a test
    run) keeps each arena's freed chunks (one arena per thread, up to 8 per core), and its RSS grows by about a
    model per arena. A thread arena's free top is not trimmed this way, so some of that stays. Returns whether
    glibc did it (False off glibc)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return True


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`); None where it has none."""
    try:
        with open(THP_MODE_FILE) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def huge_pages_on_request() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks for them (THP mode `always` or
    `madvise`, not `never`)."""
    return thp_mode() in ("always", "madvise")


def huge_pages_for_tensors() -> bool:
    """Have torch's CPU allocator ask for transparent huge pages (2 MiB) for every block of 2 MiB or more.

    The weights, the KV cache and a prefill's activations are walked in full every step; on 4 KiB pages that
    is a TLB miss every 4 KiB. torch reads the switch once, at the process's first such allocation, so call
    this before a model is loaded; an explicit THP_MEM_ALLOC_ENABLE=0 is left alone. Returns whether the
    kernel gives huge pages to memory that asks for them (THP mode `always` or `madvise`, not `never`).
    """
    if not huge_pages_on_request():
        return False
    os.environ.setdefault(TORCH_THP_ENV, "1")
    return os.environ[TORCH_THP_ENV] == "1"


def cache_dir() -> Path:
    """$KVRELAY_CACHE_DIR, else $XDG_CACHE_HOME/kvrelay, else ~/.cache/kvrelay."""
    if explicit := os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvrelay"
