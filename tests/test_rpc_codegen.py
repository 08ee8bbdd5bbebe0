"""The generated gRPC code in router/rpc/gen must match proto/ (regenerate:
``.venv/bin/python -m router.rpc.codegen``)."""

from __future__ import annotations

import pathlib
import shutil

from router.rpc import codegen


def test_generated_code_is_up_to_date() -> None:
    assert codegen.stale_files() == []


def test_check_detects_a_stale_file(tmp_path: pathlib.Path) -> None:
    copy = tmp_path / "gen"
    shutil.copytree(codegen.GEN_DIR, copy)
    target = copy / "router_pb2.pyi"
    target.write_text(target.read_text() + "\nclass Extra: ...\n")
    (copy / "router_pb2_grpc.py").unlink()
    assert codegen.stale_files(copy) == ["router_pb2.pyi", "router_pb2_grpc.py"]


def test_generated_modules_import_with_relative_imports() -> None:
    from router.rpc.gen import admin_pb2_grpc, index_pb2_grpc, router_pb2, router_pb2_grpc

    assert router_pb2.PickRequest(model="m").model == "m"
    assert hasattr(router_pb2_grpc, "RouterServicer")
    assert hasattr(index_pb2_grpc, "IndexStub") and hasattr(admin_pb2_grpc, "AdminStub")
