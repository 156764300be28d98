"""The committed generated code equals a fresh regeneration (CI fails on drift)."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]
COMMITTED = REPO / "trace_common" / "protos_gen"


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_regenerating_changes_nothing(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "protos_gen"
    subprocess.run(
        [sys.executable, str(REPO / "protos" / "generate.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    fresh, committed = _tree(out), _tree(COMMITTED)
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"generated code is stale, run `make protos` and commit: {stale}"


def test_every_service_module_imports() -> None:
    for pkg in ("common", "quantcache", "weightsync", "rollout", "trainer"):
        mod = importlib.import_module(f"trace_common.protos_gen.trace.{pkg}.v1.{pkg}_pb2")
        assert mod.DESCRIPTOR.package == f"trace.{pkg}.v1"
        importlib.import_module(f"trace_common.protos_gen.trace.{pkg}.v1.{pkg}_pb2_grpc")
