"""The generated gRPC stubs are made by one script, must match the .proto sources, and the declared
dependencies admit only the grpc and protobuf versions the stubs accept at import."""

import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "shared" / "proto_gen" / "kvrelay" / "engine" / "v1"


def test_generated_stubs_are_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _lowest_admitted(req: Requirement) -> Version:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert lows, f"{req} has no lower bound"
    return max(lows)


def test_dependency_bounds_match_the_stubs():
    deps = {r.name: r for r in map(Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())
                                   ["project"]["dependencies"])}
    grpc_stub = (STUBS / "engine_pb2_grpc.py").read_text()
    generated = Version(re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1))
    assert _lowest_admitted(deps["grpcio"]) >= generated  # older grpc raises at import
    assert deps["grpcio-tools"].specifier.contains(str(generated))  # --check regenerates with the same tool
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", (STUBS / "engine_pb2.py").read_text())
    major, minor, patch = map(int, gencode.groups())
    assert _lowest_admitted(deps["protobuf"]) >= Version(f"{major}.{minor}.{patch}")
    assert not deps["protobuf"].specifier.contains(f"{major + 1}.0.0")  # another major version refuses the stubs
