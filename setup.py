"""Packaging: one import root, `kvrelay`, mapped over the repository's top-level folders (pyproject.toml's
[tool.setuptools.package-dir]). setuptools' package finder cannot follow that mapping, so the packages are
listed here, found under each mapped folder."""

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
MAPPING = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
nested = {folder for package, folder in MAPPING.items() if package != "kvrelay"}
packages = []
for package, folder in MAPPING.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(ROOT / folder) if sub.split(".")[0] not in nested]
setup(packages=packages)
