"""The one way a benchmark reports: JSON on stdout and, when a path is given, the same JSON in a file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, path: str | Path | None) -> Path | None:
    """Print `report` as indented JSON; write it to `path` too (parent folders created). Returns the path."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is None:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return out
