"""`trace-rl demo --rollout-engine vllm`: the RL system with its rollout replica serving on
vLLM (TRACE's trace_fp4 method), through the real services. Needs vllm: `make test-vllm` runs
it in its own venv; without vllm it is skipped with that reason."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

# (no timeout marker: the vllm venv has no pytest-timeout; the demo's subprocess is bounded)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make test-vllm)"
)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_demo_on_vllm_learns_with_versions_loaded_in_place(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "trace_common.cli", "demo", "--rollout-engine", "vllm",
           "--steps", "6", "--replicas", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    log = (out / "logs" / "rollout-0.log").read_text()
    assert "trace_fp4" in log, "the replica did not serve through the trace_fp4 method"
    for r in rows:
        assert r["samples_trained"] == r["samples"] and r["samples_dropped_records"] == 0, r
        # full records from vLLM, replayed by the trainer: the guided sites match exactly
        assert r["d_act_max"] == 0.0 and r["code_flip_rate"] == 0.0, r
    # every version after the first is loaded into the running engine (no engine restart)
    assert all(r["weight_pull_seconds"] < 2.0 for r in rows[1:]), [
        r["weight_pull_seconds"] for r in rows
    ]
    first, last3 = rows[0]["reward_mean"], sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last3 > first, f"reward did not rise: step 1 {first:.3f}, last 3 steps {last3:.3f}"
