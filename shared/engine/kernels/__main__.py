"""`python -m kvrelay.engine.kernels`: build the native CPU kernels now (exit 1 when they cannot be built)."""

import logging

from kvrelay.engine.kernels import load

logging.basicConfig(level=logging.INFO, format="%(message)s")
raise SystemExit(0 if load() is not None else 1)
