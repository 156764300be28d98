"""Faults injected into a running system (issue 28): real processes, a real Redis, gRPC over
loopback. Each case asserts that the run finishes with one metrics row per step and every
sample trained (none dropped)."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import grpc
import pytest

from trace_common.clients import WeightSyncClient
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.rl.cluster import ClusterConfig, LocalCluster
from trace_common.rl.plots import read_metrics
from trace_common.service.grpc_server import AUTH_HEADER

pytestmark = pytest.mark.timeout(400)

RUN_TIMEOUT_S = 180.0
SAMPLES_PER_STEP = 8  # 2 prompts x 4 completions
TRAINER_ENV = {
    "TRACE_TASK": "reverse",
    "TRACE_TASK_DIFFICULTY": "2",
    "TRACE_PROMPTS_PER_STEP": "2",
    "TRACE_GROUP_SIZE": "4",
    "TRACE_PROMPTS_PER_UNIT": "1",
    "TRACE_START_PAUSED": "true",
}


@pytest.fixture()
def cluster(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    cfg = ClusterConfig(
        replicas=1,
        heartbeat_timeout_s=2.0,
        trainer_env={**TRAINER_ENV, "TRACE_RUN_ID": "boot", "TRACE_STEPS": "1"},
        rollout_env={"TRACE_HEARTBEAT_INTERVAL_SECONDS": "0.5"},
    )
    with LocalCluster(cfg, tmp_path / "logs") as c:
        yield c


def _auth(c: LocalCluster) -> tuple[tuple[str, str]]:
    return ((AUTH_HEADER, f"Bearer {c.config.token}"),)


def _trainer(c: LocalCluster) -> trainer_pb2_grpc.TrainerStub:
    assert c.trainer is not None
    return trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(c.trainer.grpc_address))


def _wait(c: LocalCluster, done, what: str) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        st = c.trainer_status()
        if done(st):
            return st
        assert st["state"] != "failed", f"trainer failed while waiting for {what}: {st['detail']}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(0.2)


def _settled(c: LocalCluster, quiet_s: float = 2.0) -> dict:
    """The paused trainer's status once its step in flight (if any) has finished: "paused"
    is reported at once, the loop stops between steps."""
    st = c.trainer_status()
    while True:
        time.sleep(quiet_s)
        now = c.trainer_status()
        if (now["step"], now["policy_version"]) == (st["step"], st["policy_version"]):
            return now
        st = now


def _assert_every_sample_trained(metrics: pathlib.Path, steps: int) -> None:
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "one row per step"
    for r in rows:
        assert r["samples"] == SAMPLES_PER_STEP, r
        assert r["samples_trained"] == SAMPLES_PER_STEP, r
        assert r["samples_dropped_records"] == 0 and r["samples_dropped_stale"] == 0, r


def test_weight_sync_restart_mid_run_loses_nothing(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """weight-sync killed twice: once between steps together with the replica (the fresh
    replica can only load the version the trainer publishes again), once in the middle of
    the run. Replicas register again by themselves; the run finishes with nothing lost."""
    metrics = tmp_path / "metrics.jsonl"
    steps = 8
    assert cluster.trainer is not None
    cluster.trainer.stop()
    env = {"TRACE_RUN_ID": "chaos-ws", "TRACE_STEPS": str(steps),
           "TRACE_METRICS_FILE": str(metrics)}  # fmt: skip
    cluster.start_trainer(wait=True, env=env)
    stub = _trainer(cluster)
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=_auth(cluster), timeout=10)
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    stub.Pause(trainer_pb2.PauseRequest(reason="chaos"), metadata=_auth(cluster), timeout=10)
    _wait(cluster, lambda st: st["state"] == "paused", "the pause")
    before = _settled(cluster)

    # 1. weight-sync and the only replica die together; both come back empty.
    cluster.restart_weight_sync(down_s=0.5)
    cluster.restart_replica(0)
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=_auth(cluster), timeout=10)
    _wait(cluster, lambda st: st["step"] >= before["step"] + 2, "two more steps")

    # 2. weight-sync dies mid-run; the replica keeps its weights and registers again.
    at_kill = cluster.trainer_status()["step"]
    cluster.restart_weight_sync(down_s=1.0)
    final = _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")

    assert final["step"] == steps and at_kill <= steps - 2, (at_kill, final)
    assert final["versions_republished"] >= 1, final  # the fresh replica needed it
    _assert_every_sample_trained(metrics, steps)
    assert cluster.weight_sync is not None
    ws = WeightSyncClient(cluster.weight_sync.grpc_address, cluster.config.token)
    deadline = time.monotonic() + 10
    while True:  # the replica re-registered with the new weight-sync and holds the final version
        listed = {r.replica_id: r for r in ws.replicas()}
        ok = "rollout-0" in listed and listed["rollout-0"].version_held == final["policy_version"]
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ok, listed
    assert listed["rollout-0"].alive
