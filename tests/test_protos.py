"""The committed gRPC stubs (protos/gen/) are what protos/generate.py makes from the .proto files today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path):
    # the one command users run (`make protos` runs this script), in its own process: grpc_tools' bundled
    # protobuf runtime must not be loaded into a process that already holds torch, nixl and the C++ kernels
    r = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    committed_dir = ROOT / "protos" / "gen"
    committed = {
        p.relative_to(committed_dir): p.read_bytes()
        for p in committed_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(fresh) == sorted(committed), "protos/gen has missing or extra files: run `make protos`"
    stale = [str(k) for k in fresh if fresh[k] != committed[k]]
    assert not stale, f"stale generated stubs {stale}: run `make protos`"
    assert len(fresh) >= 6 * 3  # six services, three files each


def test_stubs_import_as_the_tokenmill_package():
    from tokenmill.v1 import decode_pb2, decode_pb2_grpc, frontend_pb2, router_pb2

    assert hasattr(decode_pb2_grpc, "DecodeStub")
    req = frontend_pb2.GenerateRequest(prompt="hi")
    assert req.WhichOneof("input") == "prompt"
    assert decode_pb2.DESCRIPTOR.package == router_pb2.DESCRIPTOR.package == "tokenmill.v1"
