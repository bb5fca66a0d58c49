"""Log format shared by every kvrelay command: time, level, logger, message on stderr."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int = logging.INFO) -> None:
    """Set up the root logger once; a no-op when the process (or a test runner) already did."""
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)


def exit_now(code: int):
    """Flush the logs and standard streams and end the process at once, skipping the interpreter's teardown.

    For a server that has already stopped in order (deregistered, drained, closed its connections and
    connector): what is left is freeing memory the kernel frees anyway, and an interpreter holding torch,
    gRPC and UCX takes over a second to tear itself down (the longest part of an idle fleet's stop)."""
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
