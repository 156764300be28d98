"""New versions broadcast from the trainer to the replicas (TRACE_BROADCAST=gloo: the same
process groups as NCCL's across nodes, over host memory) with real processes: weight-sync
forms the group, the trainer hosts its store, the replicas join it and serve what arrived.
A replica killed before a broadcast fails that broadcast: the trainer and the other replica
go on, the version is pulled, and the next group leaves the dead replica out."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.launch.plots import read_metrics
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.stores.redis_local import free_port

pytestmark = pytest.mark.timeout(300)

RUN = {
    "task": {"name": "reverse", "difficulty": 2},
    "prompts_per_step": 4,
    "group_size": 4,
    "dispatch.prompts_per_unit": 1,
    "max_staleness": 0,  # each step waits for its version: every version is broadcast alone
}
TIMEOUT_S = 3.0  # a broadcast waits this long for a member that is gone


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("broadcast")
    cfg = ClusterConfig(
        replicas=2,
        heartbeat_timeout_s=2.0,
        run={**RUN, "run_id": "boot", "steps": 1},
        trainer_env={
            "TRACE_START_PAUSED": "true",
            "TRACE_BROADCAST": "gloo",
            "TRACE_BROADCAST_PORT": str(free_port()),
            "TRACE_BROADCAST_TIMEOUT_SECONDS": str(TIMEOUT_S),
        },
        rollout_env={"TRACE_BROADCAST": "gloo"},
    )
    with LocalCluster(cfg, root / "logs") as c:
        c.root = root  # type: ignore[attr-defined]
        yield c


def run(c: LocalCluster, run_id: str, steps: int) -> tuple[dict, list[dict]]:
    out: pathlib.Path = c.root / run_id  # type: ignore[attr-defined]
    if c.trainer is not None:
        c.trainer.stop()
    c.start_trainer(
        wait=True,
        run={"run_id": run_id, "steps": steps},
        env={"TRACE_METRICS_FILE": str(out / "metrics.jsonl")},
    )
    stub = trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(c.trainer.grpc_address))
    auth = ((AUTH_HEADER, f"Bearer {c.config.token}"),)
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=auth, timeout=10)
    deadline = time.monotonic() + 150
    while (st := c.trainer_status())["state"] not in ("finished", "failed"):
        assert time.monotonic() < deadline, f"trainer did not finish: {st}"
        time.sleep(0.3)
    assert st["state"] == "finished", st["detail"]
    return st, read_metrics(out / "metrics.jsonl")


def replica_status(c: LocalCluster, i: int, version: int) -> dict:
    """Replica i's /status once it serves `version` (or after 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        st = httpx.get(f"{c.rollouts[i].http_url}/status", timeout=5).json()
        if st["policy_version"] >= version or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def test_versions_arrive_in_the_broadcast(cluster: LocalCluster) -> None:
    st, rows = run(cluster, "bcast", 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the replicas registered before the run resumed: every version broadcast
        assert r["weight_broadcast_members"] == 2 and r["weight_broadcast_failures"] == 0, r
    for i in (0, 1):
        rs = replica_status(cluster, i, st["policy_version"])
        assert rs["policy_version"] == st["policy_version"]
        assert rs["last_weight_pull"]["kind"] == "broadcast", rs["last_weight_pull"]
        assert rs["weight_broadcast_failures_total"] == 0


def test_a_dead_member_fails_one_broadcast_and_nothing_else(cluster: LocalCluster) -> None:
    cluster.rollouts[1].proc.kill()  # weight-sync still counts it alive for 2 s
    st, rows = run(cluster, "dead-member", 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["samples_trained"] == 16 for r in rows), rows
    failed = rows[-1]["weight_broadcast_failures"]
    assert failed >= 1  # a group with the dead replica in it: the broadcast timed out
    assert rows[-1]["weight_broadcast_members"] == 1  # and it is left out once it is dead
    rs = replica_status(cluster, 0, st["policy_version"])
    assert rs["policy_version"] == st["policy_version"]
    assert rs["last_weight_pull"]["kind"] == "broadcast"
