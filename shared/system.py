"""Operating-system helpers the launchers, nodes and tests share: free ports, advertised host names, and
children that die with their parent."""

from __future__ import annotations

import ctypes
import signal
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it soon; another process could take it first)."""
    with socket.socket() as s:
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
