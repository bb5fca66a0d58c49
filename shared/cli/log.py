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
