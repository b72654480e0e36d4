"""Regenerate the Python gRPC code from proto/ (one command: ``python proto/generate.py``).

Writes ``stagemesh_core/v1/*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to
the package so generated imports (``from stagemesh_core.v1 import stage_pb2``)
resolve inside the core package (``stagemesh_core``). The proto package stays
``stagemesh.v1`` (the gRPC contract); only the file's place in the tree
says where its Python code lives. ``--check`` regenerates
into a temporary directory and exits 1 if the checked-in files differ (CI runs
it through tests/test_proto_generated.py).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    include = Path(protoc.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *map(str, PROTOS)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Exactly the files protoc writes for our protos: globbing ``out_dir`` would also match
    # generated code of installed packages when ``out_dir`` holds a virtualenv.
    generated = sorted(proto.with_name(proto.stem + suffix) for proto in PROTOS
                       for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    for package in {p.parent for p in generated}:
        init = out_dir / package / "__init__.py"
        init.write_text('"""Generated from proto/ by proto/generate.py; do not edit."""\n')
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(ROOT):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [p for p in fresh if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)]
    for path in stale:
        print(f"stale: {path} (run: python proto/generate.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
