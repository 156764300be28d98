"""The whole system with real processes, a real Redis and real gRPC: a local Redis,
quant-cache, weight-sync, the trainer and two rollout replicas.

One cluster serves the module; the tests run in file order and each starts its own trainer
run (a fresh run id and directories), so they do not depend on each other's results.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from trace_common.clients import WeightSyncClient
from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.launch.plots import read_metrics
from trace_common.model import QuantConfig, get_config
from trace_common.model.config import ACT_SITE_TO_QUANT_SITE, GUIDED_SITES
from trace_common.protos_gen.trace.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.rl.audit import read_audit
from trace_common.rl.checkpoint import latest_checkpoint, load_checkpoint
from trace_common.service.grpc_server import AUTH_HEADER

pytestmark = pytest.mark.timeout(240)

RUN_TIMEOUT_S = 120.0
# Small and fast: 4 prompts x 4 completions per step, 1 prompt per work unit. Each test's
# trainer run adds its own keys to this recipe.
BASE_RUN = {
    "task": {"name": "reverse", "difficulty": 2},
    "prompts_per_step": 4,
    "group_size": 4,
    "dispatch.prompts_per_unit": 1,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("cluster")
    cfg = ClusterConfig(
        replicas=2,
        heartbeat_timeout_s=2.0,
        run={**BASE_RUN, "run_id": "boot", "steps": 1},
        trainer_env={"TRACE_START_PAUSED": "true"},  # each test resumes it once it is watching
        rollout_env={"TRACE_RECORD_AUDIT_FILE": str(root / "rollout-audit.jsonl")},
    )
    with LocalCluster(cfg, root / "logs") as c:
        c.root = root  # type: ignore[attr-defined]
        yield c


def trainer_stub(c: LocalCluster) -> trainer_pb2_grpc.TrainerStub:
    assert c.trainer is not None
    return trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(c.trainer.grpc_address))


def auth(c: LocalCluster) -> tuple[tuple[str, str]]:
    return ((AUTH_HEADER, f"Bearer {c.config.token}"),)


def run_trainer(c: LocalCluster, run: dict, env: dict[str, str]) -> dict:
    """Restart the trainer with the recipe keys ``run`` and the settings ``env``, resume it,
    wait until it finishes; its last status."""
    if c.trainer is not None:
        c.trainer.stop()
    c.start_trainer(wait=True, run=run, env=env)
    return resume_until_finished(c)


def resume_until_finished(c: LocalCluster) -> dict:
    """Resume the (paused) trainer and wait until it finishes; its last status."""
    trainer_stub(c).Resume(trainer_pb2.ResumeRequest(), metadata=auth(c), timeout=10)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        st = c.trainer_status()
        if st["state"] in ("finished", "failed"):
            assert st["state"] == "finished", st["detail"]
            return st
        assert time.monotonic() < deadline, f"trainer did not finish: {st}"
        time.sleep(0.3)


def replica_versions(c: LocalCluster) -> dict[str, int]:
    out = {}
    for r in c.rollouts:
        stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(r.grpc_address))
        st = stub.Status(rollout_pb2.RolloutStatusRequest(), metadata=auth(c), timeout=5)
        out[st.replica_id] = st.policy_version
    return out


def wait_versions(c: LocalCluster, version: int, timeout: float = 15.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        got = replica_versions(c)
        if all(v == version for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_rl_steps_end_to_end(cluster: LocalCluster) -> None:
    root: pathlib.Path = cluster.root  # type: ignore[attr-defined]
    out = root / "e2e"
    st = run_trainer(
        cluster,
        {
            "run_id": "e2e",
            "steps": 3,
            "guidance": {"layers": "all", "mode": "full"},
            "max_staleness": 0,  # every sample from the version it trains: D_act is exact
            "checkpoint.every": 1,
        },
        {
            "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
            "TRACE_CHECKPOINT_DIR": str(out / "ckpt"),
            "TRACE_RECORD_AUDIT_FILE": str(out / "trainer-audit.jsonl"),
        },
    )
    # the recipe LocalCluster wrote reached the trainer: its run id and length are the run's
    assert (st["run_id"], st["total_steps"], st["mode"]) == ("e2e", 3, "trace")
    # every replica ends on the final version
    assert wait_versions(cluster, st["policy_version"]) == {
        "rollout-0": st["policy_version"],
        "rollout-1": st["policy_version"],
    }
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["samples"] == 16 and r["samples_trained"] == 16, r
        assert r["samples_dropped_records"] == 0 and r["samples_dropped_stale"] == 0
        # every record read verified: tag and the write generation its rollout reported
        assert r["samples_regenerated"] == 0 and not any(r["records_refused"].values()), r
        # all layers guided, routing replayed, same version: the trainer reproduces the rollout
        assert r["d_act_mean"] == 0.0 and r["d_act_max"] == 0.0 and r["code_flip_rate"] == 0.0
        assert r["routing_mismatch"] == 0.0
        assert r["logp_abs_diff_max"] < 1e-4, r["logp_abs_diff_max"]
        assert r["record_bytes_per_token"] > 0 and r["weight_push_seconds"] > 0
    # versions after the first travel as deltas: pushed, and pulled by the replicas
    deltas = [r for r in rows if "weight_changed_fraction" in r]
    assert deltas and all(r["weight_push_bytes"] < r["weight_push_full_bytes"] for r in deltas), (
        rows
    )
    wtext = httpx.get(f"{cluster.weight_sync.http_url}/metrics", timeout=5).text
    assert 'trace_weight_sync_pulls_total{kind="delta"}' in wtext
    # the records the trainer used are byte-for-byte the ones the rollout wrote
    written = {
        (a["run_id"], a["version"], a["sample_id"]): a["sha256"]
        for a in read_audit(root / "rollout-audit.jsonl")
    }
    used = read_audit(out / "trainer-audit.jsonl")
    assert len(used) == 3 * 16
    for a in used:
        assert written[(a["run_id"], a["version"], a["sample_id"])] == a["sha256"], a
    # metrics endpoints expose the documented series
    assert cluster.trainer is not None
    text = httpx.get(f"{cluster.trainer.http_url}/metrics", timeout=5).text
    for series in (
        "trace_trainer_reward_mean",
        "trace_trainer_logp_abs_diff_mean",
        "trace_trainer_k3_kl",
        'trace_trainer_d_act{layer="3"}',
        "trace_trainer_code_flip_rate",
        "trace_trainer_staleness_mean",
        "trace_trainer_samples_dropped_stale_total",
        'trace_trainer_run_info{run_id="e2e"} 1.0',
        'trace_trainer_rollout_tokens_per_second{replica_id="rollout-',
        "trace_trainer_weight_push_seconds",
        'trace_trainer_weight_pull_seconds{replica_id="rollout-',
        "trace_trainer_record_bytes_per_token",
        'trace_trainer_step_phase_seconds{phase="rollout"}',
        'trace_trainer_step_phase_seconds{phase="push"}',
        f"trace_trainer_policy_version {float(st['policy_version'])}",
    ):
        assert series in text, f"{series} missing from the trainer's /metrics"
    rtext = httpx.get(f"{cluster.rollouts[0].http_url}/metrics", timeout=5).text
    for series in (
        "trace_rollout_generated_tokens_total",
        "trace_rollout_record_bytes_total",
        "trace_rollout_weight_pull_seconds_count",
        f"trace_rollout_policy_version {float(st['policy_version'])}",
    ):
        assert series in rtext, f"{series} missing from the rollout's /metrics"
    assert latest_checkpoint(out / "ckpt") is not None


def test_every_site_fp4_and_guided_through_the_services(cluster: LocalCluster) -> None:
    """quant.sites = "all": every projection, embedding and LM head goes through the export,
    weight-sync and the replicas' load in FP4; every guidable site's records go through
    quant-cache; the trainer still reproduces the rollout exactly."""
    cfg = get_config("debug")
    quant = QuantConfig.every_site(cfg)
    guided = [s for s in GUIDED_SITES if quant.has(ACT_SITE_TO_QUANT_SITE[s])]
    assert {"attn_in", "o_in", "router_in"} <= set(guided)
    out = cluster.root / "e2e-all-sites"  # type: ignore[attr-defined]
    run_trainer(
        cluster,
        {
            "run_id": "e2e-all-sites",
            "steps": 1,
            "quant.sites": "all",
            "guidance": {
                "sites": ",".join(guided),
                "layers": "all",
                "mode": "full",  # compact records hold 1 bit: D_act needs full ones
            },
            "max_staleness": 0,
        },
        {"TRACE_METRICS_FILE": str(out / "metrics.jsonl")},
    )
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["samples_trained"] == 16 and row["samples_dropped_records"] == 0, row
    assert row["d_act_max"] == 0.0 and row["code_flip_rate"] == 0.0, row
    # every guided layer x site was measured (d_act_per_layer: max over that layer's sites)
    assert sorted(row["d_act_per_layer"]) == [str(i) for i in range(cfg.num_layers)], row
    assert row["logp_abs_diff_max"] < 1e-4, row["logp_abs_diff_max"]


def test_trainer_restart_resumes_same_step_same_weights(cluster: LocalCluster) -> None:
    root: pathlib.Path = cluster.root  # type: ignore[attr-defined]
    out = root / "resume"
    run = {"run_id": "resume", "steps": 2, "checkpoint.every": 1}
    env = {
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
        "TRACE_CHECKPOINT_DIR": str(out / "ckpt"),
    }
    first = run_trainer(cluster, run, env)
    ckpt = load_checkpoint(latest_checkpoint(out / "ckpt"))
    assert (ckpt.step, first["step"]) == (2, 2)
    # restart from the checkpoint, paused: it must stand at the same step with the same weights
    cluster.trainer.stop()  # type: ignore[union-attr]
    cluster.start_trainer(wait=True, run={**run, "steps": 3}, env=env)
    st = cluster.trainer_status()
    assert st["state"] == "paused" and st["step"] == 2
    assert st["resumed_from"] and st["weights_digest"] == ckpt.extra["weights_digest"]
    assert st["policy_version"] == first["policy_version"]  # replicas already hold it
    # ... and the version the replicas serve is exactly the checkpoint's weights, quantized
    ws = WeightSyncClient(cluster.weight_sync.grpc_address, cluster.config.token)  # type: ignore[union-attr]
    _, pushed, _ = ws.pull_version(st["policy_version"], replica_id="e2e-check")
    from trace_common.launch.demo import DemoConfig, demo_model
    from trace_common.model import QuantConfig
    from trace_common.rl.policy import LearnerConfig, ModelLearner
    from trace_common.tasks import CharTokenizer

    tok = CharTokenizer()
    model = demo_model(DemoConfig.load(), tok.vocab_size)
    model.load_state_dict(ckpt.model)
    learner = ModelLearner(model, LearnerConfig(mode="trace"), quant=QuantConfig(), guidance=None,
                           eos_id=tok.eos_id, pad_id=tok.pad_id)  # fmt: skip
    exported, _ = learner.export_weights()
    assert set(exported) == set(pushed)
    for name, t in exported.items():
        assert t.dtype == pushed[name].dtype and bool((t == pushed[name]).all()), name
    # resume: it continues with step 3, nothing repeated
    stub = trainer_stub(cluster)
    stub.Resume(trainer_pb2.ResumeRequest(), metadata=auth(cluster), timeout=10)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while cluster.trainer_status()["state"] != "finished":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    status = stub.GetStatus(trainer_pb2.GetStatusRequest(), metadata=auth(cluster), timeout=5)
    assert status.state == trainer_pb2.TRAINER_STATE_FINISHED and status.step == 3
    with pytest.raises(grpc.RpcError) as err:
        stub.Pause(trainer_pb2.PauseRequest(reason="x"), metadata=auth(cluster), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def start_trainer_ranks(c: LocalCluster, ranks: int, run: dict, env: dict[str, str]) -> None:
    """The trainer as `ranks` learner ranks under torchrun (gloo on the CPU): rank 0 serves."""
    if c.trainer is not None:
        c.trainer.stop()
    torchrun = str(pathlib.Path(sys.executable).parent / "torchrun")
    argv = [torchrun, "--standalone", f"--nproc-per-node={ranks}", "-m", "services.trainer"]
    c.start_trainer(wait=True, run=run, env=env, argv=argv)


def wait_past_starting(c: LocalCluster) -> dict:
    """The trainer's status once it has left "starting" (the ranks build and load first)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (st := c.trainer_status())["state"] == "starting":
        assert time.monotonic() < deadline, "the trainer never left 'starting'"
        time.sleep(0.1)
    return st


def test_trainer_as_two_ranks_resumes_at_one(cluster: LocalCluster) -> None:
    """torchrun, 2 ranks: two RL steps through the real services (each rank pulls its own
    records), sharded checkpoints; then 1 rank resumes the 2-rank checkpoint and finishes."""
    root: pathlib.Path = cluster.root  # type: ignore[attr-defined]
    out = root / "ranks"
    run = {"run_id": "ranks", "steps": 2, "checkpoint.every": 1}
    env = {
        "TRACE_METRICS_FILE": str(out / "metrics.jsonl"),
        "TRACE_CHECKPOINT_DIR": str(out / "ckpt"),
    }
    start_trainer_ranks(cluster, 2, run, env)
    st = wait_past_starting(cluster)
    assert st["world_size"] == 2 and st["state"] == "paused"
    first = resume_until_finished(cluster)
    assert first["step"] == 2
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["samples_trained"] > 0 and r["samples_dropped_records"] == 0 for r in rows)
    assert wait_versions(cluster, first["policy_version"]) == {
        "rollout-0": first["policy_version"],
        "rollout-1": first["policy_version"],
    }
    state = json.loads((latest_checkpoint(out / "ckpt") / "trainer_state.json").read_text())  # type: ignore[operator]
    assert (state["step"], state["world_size"]) == (2, 2)
    start_trainer_ranks(cluster, 1, {**run, "steps": 3}, env)
    st = wait_past_starting(cluster)
    assert (st["world_size"], st["step"], st["state"]) == (1, 2, "paused")
    assert st["resumed_from"] and st["policy_version"] == first["policy_version"]
    assert resume_until_finished(cluster)["step"] == 3
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]


def test_killing_a_replica_mid_step_loses_no_sample(cluster: LocalCluster) -> None:
    root: pathlib.Path = cluster.root  # type: ignore[attr-defined]
    out = root / "kill"
    run = {
        "run_id": "kill",
        "steps": 3,
        "prompts_per_step": 8,
        "group_size": 8,
        "dispatch.prompts_per_unit": 2,
        "sampling.max_new_tokens": 24,  # random init never says EOS: long generate calls
    }
    if cluster.trainer is not None:
        cluster.trainer.stop()
    cluster.start_trainer(
        wait=True, run=run, env={"TRACE_METRICS_FILE": str(out / "metrics.jsonl")}
    )
    victim = cluster.rollouts[1]
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(victim.grpc_address))
    trainer_stub(cluster).Resume(trainer_pb2.ResumeRequest(), metadata=auth(cluster), timeout=10)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:  # kill the victim while it is generating a work unit of step 2
        st = cluster.trainer_status()
        busy = stub.Status(rollout_pb2.RolloutStatusRequest(), metadata=auth(cluster), timeout=5)
        if st["step"] >= 1 and busy.requests_in_flight > 0:
            victim.kill()
            break
        assert st["step"] < 3 and time.monotonic() < deadline, "never caught the victim busy"
        time.sleep(0.01)
    while (st := cluster.trainer_status())["state"] not in ("finished", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert st["state"] == "finished", st["detail"]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every step got all 8 x 8 completions, none lost, none counted twice
        assert r["samples"] == 64, r
    assert sum(r["redispatched_units"] for r in rows) >= 1
    assert any("rollout-1" in r["failed_replicas"] for r in rows)
    survivor = replica_versions(LocalClusterView(cluster.rollouts[:1], cluster))
    assert survivor == {"rollout-0": st["policy_version"]} or wait_versions(
        LocalClusterView(cluster.rollouts[:1], cluster), st["policy_version"]
    ) == {"rollout-0": st["policy_version"]}
    json.dumps(rows)  # metrics rows are plain JSON


class LocalClusterView:
    """The cluster with only some replicas (for the survivor check)."""

    def __init__(self, rollouts, cluster: LocalCluster) -> None:
        self.rollouts = rollouts
        self.config = cluster.config
