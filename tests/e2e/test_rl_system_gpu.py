"""The whole system on one GPU machine: a local Redis, quant-cache, weight-sync, the
trainer and two rollout replicas as processes, the trainer and both replicas on the GPU
(TRACE_DEVICE=cuda, TRACE_ROLLOUT_ENGINE=auto).

Each test starts its own cluster, because a replica's CUDA engine keeps the shape and the
guidance mode of the first policy it loads:
- full records at every layer (the replicas fall back to the PyTorch engine on CUDA, which
  records full guidance): the reward pipeline, D_act measured and small, push and pull;
- compact records (the CUDA engine) while a replica is killed mid-step;
- the mid-1b shape: the trainer and two replicas fit on one GPU (marked slow).
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import pytest

from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.launch.plots import read_metrics
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service.grpc_server import AUTH_HEADER

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

RUN_TIMEOUT_S = 300.0
GPU_ENV = {"TRACE_DEVICE": "cuda"}
ROLLOUT_ENV = {**GPU_ENV, "TRACE_ROLLOUT_ENGINE": "auto"}
TRAINER_ENV = {**GPU_ENV, "TRACE_START_PAUSED": "true"}  # each test resumes it once watching
BASE_RUN = {  # the recipe keys of every run here; each test adds its own
    "task": {"name": "reverse", "difficulty": 2},
    "prompts_per_step": 4,
    "group_size": 4,
    "dispatch.prompts_per_unit": 1,
}


def auth(c: LocalCluster) -> tuple[tuple[str, str]]:
    return ((AUTH_HEADER, f"Bearer {c.config.token}"),)


def rollout_status(c: LocalCluster, i: int) -> rollout_pb2.RolloutStatusResponse:
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(c.rollouts[i].grpc_address))
    return stub.Status(rollout_pb2.RolloutStatusRequest(), metadata=auth(c), timeout=5)


def resume(c: LocalCluster) -> None:
    assert c.trainer is not None
    stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(c.trainer.grpc_address))
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=auth(c), timeout=10)


def wait_finished(c: LocalCluster) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (st := c.trainer_status())["state"] not in ("finished", "failed"):
        assert time.monotonic() < deadline, f"trainer did not finish: {st}"
        time.sleep(0.3)
    assert st["state"] == "finished", st["detail"]
    return st


def wait_versions(c: LocalCluster, idx: list[int], version: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = {rollout_status(c, i).replica_id: rollout_status(c, i).policy_version for i in idx}
        if all(v == version for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def cluster_with(
    root: pathlib.Path, run: Mapping[str, Any], trainer_env: Mapping[str, str]
) -> LocalCluster:
    """Two replicas and a trainer for the recipe keys `run` (on top of BASE_RUN)."""
    cfg = ClusterConfig(
        replicas=2,
        heartbeat_timeout_s=2.0,
        run={**BASE_RUN, **run},
        trainer_env={**TRAINER_ENV, **trainer_env},
        rollout_env=ROLLOUT_ENV,
    )
    return LocalCluster(cfg, root / "logs")


@pytest.fixture
def root(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    yield tmp_path


def test_gpu_steps_reward_records_push_and_pull(root: pathlib.Path) -> None:
    out = root / "run"
    run = {
        "run_id": "gpu-e2e",
        "steps": 3,
        "guidance.layers": "all",
        "guidance.mode": "full",  # D_act needs full records
        "max_staleness": 0,  # every sample from the version it trains
        "checkpoint.every": 3,
    }
    env = {
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
        "TRACE_CHECKPOINT_DIR": str(out / "ckpt"),
    }
    with cluster_with(root, run, env) as c:
        st0 = c.trainer_status()
        assert st0["device"].startswith("cuda"), st0
        resume(c)
        st = wait_finished(c)
        got = wait_versions(c, [0, 1], st["policy_version"])
        assert got == {"rollout-0": st["policy_version"], "rollout-1": st["policy_version"]}
        engines = {rollout_status(c, i).engine for i in (0, 1)}
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # the reward pipeline: every completion scored, rewards in [0, 1], all trained
        assert r["samples"] == 16 and r["samples_trained"] == 16, r
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["samples_dropped_records"] == 0, r
        # the records path: every guided site measured, the trainer on the rollout's values
        assert sorted(r["d_act_per_layer"]) == ["0", "1", "2", "3"], r
        assert r["d_act_max"] < 1e-2, f"D_act {r['d_act_max']} at the guided sites (CPU: 0.0)"
        assert r["code_flip_rate"] < 1e-2, r["code_flip_rate"]
        assert math.isfinite(r["logp_abs_diff_mean"]) and r["logp_abs_diff_mean"] < 0.05, r
        assert r["record_bytes_per_token"] > 0
        # weight push and pull, every version, both replicas
        assert r["weight_push_seconds"] > 0, r
        assert set(r["weight_pull_seconds_per_replica"]) == {"rollout-0", "rollout-1"}, r
        assert r["train_peak_memory_bytes"] > 0 and r["train_tokens_per_s"] > 0, r
    # full records are not what the CUDA engine captures: the PyTorch engine on CUDA serves
    assert engines == {"native"}, engines


def test_gpu_cuda_engine_survives_a_replica_kill(root: pathlib.Path) -> None:
    out = root / "kill"
    run = {
        "run_id": "gpu-kill",
        "model.name": "gpu-small",  # the debug shape's 32-wide experts run on the PyTorch engine
        "steps": 3,
        "prompts_per_step": 8,
        "group_size": 8,
        "dispatch.prompts_per_unit": 2,
        "sampling.max_new_tokens": 48,  # random init never says EOS: long generate calls
    }
    with cluster_with(root, run, {"TRACE_METRICS_FILE": str(out / "metrics.jsonl")}) as c:
        resume(c)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:  # kill replica 1 while it generates a work unit of step 2 or later
            st = c.trainer_status()
            if st["step"] >= 1 and rollout_status(c, 1).requests_in_flight > 0:
                c.rollouts[1].kill()
                break
            assert st["step"] < 3 and time.monotonic() < deadline, "never caught replica 1 busy"
            time.sleep(0.01)
        st = wait_finished(c)
        survivor = rollout_status(c, 0)
        assert wait_versions(c, [0], st["policy_version"]) == {"rollout-0": st["policy_version"]}
    assert survivor.engine == "cuda", f"compact guidance on the GPU: engine {survivor.engine!r}"
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every step got all 8 x 8 completions, none lost, none counted twice
        assert r["samples"] == 64 and r["samples_dropped_records"] == 0, r
        # the mismatch on the fresh samples, or (a step with none) the stale ones' gap
        gap = r.get("logp_abs_diff_mean", r.get("logp_abs_diff_mean_stale"))
        assert gap is not None and math.isfinite(gap), r
    assert sum(r["redispatched_units"] for r in rows) >= 1
    assert any("rollout-1" in r["failed_replicas"] for r in rows)


@pytest.mark.slow
def test_gpu_mid1b_trainer_and_two_replicas_on_one_gpu(root: pathlib.Path) -> None:
    out = root / "mid"
    run = {
        "run_id": "gpu-mid",
        "model.name": "mid-1b",
        "steps": 2,
        "prompts_per_step": 8,
        "group_size": 8,
        "dispatch.prompts_per_unit": 4,
        "objective.lr": 1e-5,
    }
    env = {
        "TRACE_TORCH_THREADS": "8",  # the CPU-side init of 1B parameters
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
    }
    with cluster_with(root, run, env) as c:
        resume(c)
        st = wait_finished(c)
        got = wait_versions(c, [0, 1], st["policy_version"], timeout=120)
        assert got == {"rollout-0": st["policy_version"], "rollout-1": st["policy_version"]}
        engines = {rollout_status(c, i).engine for i in (0, 1)}
    assert engines == {"cuda"}, engines
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 64 and r["samples_trained"] + r["samples_dropped_stale"] == 64, r
        assert 0 < r["train_peak_memory_bytes"] < 80 * 2**30, r["train_peak_memory_bytes"]
        assert r["weight_push_seconds"] > 0 and r["weight_pull_seconds"] > 0, r
