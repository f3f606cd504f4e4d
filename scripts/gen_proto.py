"""Regenerate the committed gRPC stubs from proto/ into client/vaed_client/_proto.

Run after editing proto/vaed/v1/vaed.proto:  python scripts/gen_proto.py
tests/client/test_proto_stubs.py fails when the committed stubs are stale.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "vaed" / "v1" / "vaed.proto"
STUB_DIR = ROOT / "client" / "vaed_client" / "_proto"
GENERATED = ("vaed_pb2.py", "vaed_pb2.pyi", "vaed_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> dict[str, str]:
    """Run protoc into out_dir and return {file name: text}, imports made package-relative."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    texts = {}
    for name in GENERATED:
        text = (out_dir / "vaed" / "v1" / name).read_text()
        # protoc writes absolute imports (`from vaed.v1 import vaed_pb2`), which
        # would collide with the server package `vaed`; the stubs live inside
        # vaed_client._proto, so import their sibling relatively.
        text = text.replace("from vaed.v1 import vaed_pb2 as", "from . import vaed_pb2 as")
        texts[name] = text
    return texts


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help writes nothing
    with tempfile.TemporaryDirectory() as tmp:
        texts = generate(pathlib.Path(tmp))
    for name, text in texts.items():
        (STUB_DIR / name).write_text(text)
        print(f"wrote {STUB_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
