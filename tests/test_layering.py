"""The layering contracts (pyproject.toml, [tool.importlinter]) hold: each folder is one layer, imports point
down only, the engine stands alone, and no package has an import cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.packaging import materialize

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(tmp_path):
    """On the installed layout (kvrelay/ with gateway/, kv_transfer/, ... inside it): import-linter finds
    packages by walking folders, and the mapped folders are not under shared/."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    materialize(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
