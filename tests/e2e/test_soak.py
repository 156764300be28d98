"""The short soak (bench/soak.py, issue 45): the local system of real processes, a real Redis
and real gRPC, with client load and every kind of fault, for a minute. Nothing may be lost or
trained twice, and every service must be up at the end."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)

FAULTS = {"replica", "redis", "weight-sync", "trainer"}


def test_short_soak_loses_nothing(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "1", "--replicas", "2",
           "--fault-every", "8", "--seed", "0", "--workdir", str(tmp_path / "run"),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    tables = proc.stdout[-6000:]
    s = report["samples"]
    assert report["steps"] > 0, tables
    assert {f["fault"] for f in report["faults"]} == FAULTS, report["faults"]
    assert s["lost"] == 0 and s["duplicated"] == 0 and s["unmatched"] == 0, (s, tables)
    assert s["records_audited"] > 0 and s["trained"] == s["expected"], s
    assert all(report["alive"].values()), report["alive"]
    assert report["trainer_state"] != "failed", tables
    # the clients loaded both services, and every call was timed or counted
    assert {"weight-sync pull", "quant-cache get_records"} <= set(report["rpcs"]), report["rpcs"]
    for r in report["rpcs"].values():
        assert r["calls"] == r["ok"] + sum(r["errors"].values()) and r["ok"] > 0, r
    assert proc.returncode == (0 if report["passed"] else 1), (proc.returncode, report["targets"])
