"""The layering contracts (pyproject.toml, [tool.importlinter]) hold: each folder is one layer, imports point
down only, the engine stands alone, and no package has an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


# Spelled in pieces so that this file does not match itself.
_OUTSIDE = ("../" + "shared/", "DESIGN" + ".md")


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".yaml", ".yml", ".cfg"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if any(ref in text for ref in _OUTSIDE):
            offenders.append(name)
    assert not offenders, f"these files refer to documents outside the repository: {offenders}"
