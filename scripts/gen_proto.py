"""Regenerate the Python gRPC stubs in shared/proto_gen from proto/ (the only way they are made).

    python scripts/gen_proto.py          # write the stubs
    python scripts/gen_proto.py --check  # exit 1 when the committed stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import re
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "shared" / "proto_gen"


def generate(out: pathlib.Path) -> None:
    import grpc_tools

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for d in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    # protoc writes imports rooted at proto/; root them at this package instead of touching sys.path.
    for f in out.rglob("*_pb2*.py*"):
        text = f.read_text()
        f.write_text(re.sub(r"^from kvrelay\.", "from kvrelay.proto_gen.kvrelay.", text, flags=re.M))


def stale(a: pathlib.Path, b: pathlib.Path) -> list[str]:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    diff = sorted(str(p) for p in files_a ^ files_b)
    diff += sorted(str(p) for p in files_a & files_b if not filecmp.cmp(a / p, b / p, shallow=False))
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp) / "proto_gen"
        generate(fresh)
        if args.check:
            diff = stale(fresh, OUT_DIR) if OUT_DIR.exists() else ["shared/proto_gen missing"]
            if diff:
                print("stale generated stubs (run python scripts/gen_proto.py):", *diff, sep="\n  ")
                return 1
            return 0
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        shutil.copytree(fresh, OUT_DIR)
    print(f"wrote {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
