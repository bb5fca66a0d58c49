"""The installed layout of the `kvrelay` package, built from the repository's folders as pyproject.toml maps
them, for checks that walk folders (import-linter) or must not see the repository (a wheel's contents)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def package_dirs() -> dict[str, str]:
    """{package: repository folder}, e.g. {"kvrelay": "shared", "kvrelay.gateway": "gateway", ...}."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def materialize(dest: Path) -> Path:
    """Copy the Python sources into dest/kvrelay/... as an install would lay them out; returns dest/kvrelay."""
    for package, folder in sorted(package_dirs().items()):  # the root first, then what is mapped into it
        shutil.copytree(ROOT / folder, dest / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "csrc", "*.so"))
    return dest / "kvrelay"
