"""Generate crucible/_pb/*.py from proto/crucible.proto.

    python -m crucible.gen_proto          # regenerate in place
    python -m crucible.gen_proto --check  # exit 1 when the committed files are stale

Needs grpcio-tools (a test dependency); the generated files are committed so
that running Crucible does not.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "crucible.proto"
OUT = ROOT / "crucible" / "_pb"
FILES = ("crucible_pb2.py", "crucible_pb2_grpc.py")


def generate(out_root: pathlib.Path) -> pathlib.Path:
    from grpc_tools import protoc

    args = ["protoc", f"-Icrucible/_pb={PROTO.parent}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", str(PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return out_root / "crucible" / "_pb"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        gen = generate(pathlib.Path(tmp))
        stale = [f for f in FILES if not (OUT / f).exists() or (OUT / f).read_bytes() != (gen / f).read_bytes()]
        if args.check:
            if stale:
                print(f"stale generated files: {', '.join(stale)}; run python -m crucible.gen_proto", file=sys.stderr)
                return 1
            return 0
        OUT.mkdir(parents=True, exist_ok=True)
        for f in FILES:
            (OUT / f).write_bytes((gen / f).read_bytes())
        (OUT / "__init__.py").write_text('"""Generated from proto/crucible.proto; do not edit."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
