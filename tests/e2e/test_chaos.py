"""Faults injected into a running system: real processes, a real Redis, gRPC over
loopback. Each case asserts that the run finishes with one metrics row per step and every
sample trained exactly once, or counted as regenerated or unguided (none dropped)."""

from __future__ import annotations

import collections
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from trace_common.clients import WeightSyncClient
from trace_common.launch.cluster import ClusterConfig, LocalCluster
from trace_common.launch.plots import read_metrics
from trace_common.rl.audit import read_audit

pytestmark = pytest.mark.timeout(400)

RUN_TIMEOUT_S = 180.0
GROUP_SIZE = 4
LOSS_TRIES = 6  # Redis restarts tried at a unit gap (each can miss: too early or too late)
SAMPLES_PER_STEP = 2 * GROUP_SIZE  # 2 prompts x 4 completions, one prompt per work unit
BASE_RUN = {  # the recipe keys of every run here; each run adds its own
    "task": {"name": "reverse", "difficulty": 2},
    "prompts_per_step": 2,
    "group_size": GROUP_SIZE,
    "dispatch.prompts_per_unit": 1,
}


@pytest.fixture()
def cluster(tmp_path: pathlib.Path) -> Iterator[LocalCluster]:
    cfg = ClusterConfig(
        replicas=1,
        heartbeat_timeout_s=2.0,
        run={**BASE_RUN, "run_id": "boot", "steps": 1},
        trainer_env={"TRACE_START_PAUSED": "true"},
        rollout_env={"TRACE_HEARTBEAT_INTERVAL_SECONDS": "0.5"},
    )
    with LocalCluster(cfg, tmp_path / "logs") as c:
        yield c


def _wait(c: LocalCluster, done, what: str) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        st = c.trainer_status()
        if done(st):
            return st
        assert st["state"] != "failed", f"trainer failed while waiting for {what}: {st['detail']}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st}"
        time.sleep(0.2)


def _start_run(
    c: LocalCluster,
    tmp_path: pathlib.Path,
    run_id: str,
    steps: int,
    *,
    stop: bool = True,
    run: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Replace the fixture's trainer (stopped first unless `stop` is false: it was killed) by
    one for run `run_id` with the recipe keys `run` and the settings `env` (metrics.jsonl and
    the record audit under `tmp_path`); let it run."""
    assert c.trainer is not None
    if stop:
        c.trainer.stop()
    env = {"TRACE_METRICS_FILE": str(tmp_path / "metrics.jsonl"),
           "TRACE_RECORD_AUDIT_FILE": str(tmp_path / "trainer-audit.jsonl"), **(env or {})}  # fmt: skip
    c.start_trainer(wait=True, run={"run_id": run_id, "steps": steps, **(run or {})}, env=env)
    c.resume_trainer()


def _assert_every_sample_trained(tmp_path: pathlib.Path, steps: int) -> dict[str, int]:
    """One metrics row per step; every sample of every step trained, none dropped, no record
    blob trained twice. Returns the run's regenerated / unguided totals."""
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "one row per step"
    for r in rows:
        assert r["samples"] == SAMPLES_PER_STEP, r
        assert r["samples_trained"] == SAMPLES_PER_STEP, r
        assert r["samples_dropped_records"] == 0 and r["samples_dropped_stale"] == 0, r
    # The blobs each trainer process trained on (a resumed trainer writes its own file): each
    # sample id once per process.
    for audit in sorted(tmp_path.glob("trainer-audit*.jsonl")):
        ids = collections.Counter((a["version"], a["sample_id"]) for a in read_audit(audit))
        assert not [k for k, n in ids.items() if n > 1], f"a record trained twice ({audit.name})"
    return {k: sum(r[k] for r in rows) for k in ("samples_regenerated", "samples_unguided")}


def test_weight_sync_restart_mid_run_loses_nothing(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """weight-sync killed twice: once between steps together with the replica (the fresh
    replica can only load the version the trainer publishes again), once in the middle of
    the run. Replicas register again by themselves; the run finishes with nothing lost."""
    steps = 8
    _start_run(cluster, tmp_path, "chaos-ws", steps)
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    cluster.pause_trainer("chaos")
    _wait(cluster, lambda st: st["state"] == "paused", "the pause")
    before = cluster.settled_status()

    # 1. weight-sync and the only replica die together; both come back empty.
    cluster.restart_weight_sync(down_s=0.5)
    cluster.restart_replica(0)
    cluster.resume_trainer()
    _wait(cluster, lambda st: st["step"] >= before["step"] + 2, "two more steps")

    # 2. weight-sync dies mid-run; the replica keeps its weights and registers again.
    at_kill = cluster.trainer_status()["step"]
    cluster.restart_weight_sync(down_s=1.0)
    final = _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")

    assert final["step"] == steps and at_kill <= steps - 2, (at_kill, final)
    assert final["versions_republished"] >= 1, final  # the fresh replica needed it
    _assert_every_sample_trained(tmp_path, steps)
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


# Longer completions (the random policy rarely stops early) keep a work unit generating long
# enough for `_at_unit_gap` to see the gap between a step's two units on a fast machine.
SLOW_UNITS = {"sampling.max_new_tokens": 48}


def _at_unit_gap(c: LocalCluster, run_id: str) -> int:
    """Block until a step's first work unit has stored all its records and the second none
    (one replica runs the units one after the other, so it is generating the second, and the
    trainer, which reads once both are done, has read nothing). Returns that step's index."""
    assert c.redis is not None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        st = c.trainer_status()
        assert st["state"] == "running", f"the run ended before a unit gap was seen: {st}"
        step = st["step"]
        admin = redis.Redis.from_url(c.redis.url)
        try:
            # all of unit 0's records (a partly written batch would be written again in full)
            first = admin.keys(f"trace:qc:{run_id}:*:s{step}-u0-a0-*")
            if len(first) == GROUP_SIZE and not admin.keys(f"trace:qc:{run_id}:*:s{step}-u1-*"):
                return step
        finally:
            admin.close()
        time.sleep(0.005)
    raise AssertionError("never saw a step between its two work units")


def _rows(metrics: pathlib.Path) -> list[dict]:
    return read_metrics(metrics) if metrics.exists() else []


def _row(metrics: pathlib.Path, c: LocalCluster, step: int) -> dict:
    """The metrics row of step index `step`, once written."""
    _wait(c, lambda _st: len(_rows(metrics)) > step, f"step {step + 1}'s row")
    return read_metrics(metrics)[step]


def _restart_redis_between_units(c: LocalCluster, run_id: str, metrics: pathlib.Path) -> int:
    """Restart Redis empty between a step's two units: the first group's records are lost for
    good. A restart that came too early (the writer's retry stores the record again) or too
    late is tried again at a later step. Returns the index of the step that lost records."""
    lost = ("samples_regenerated", "samples_unguided", "samples_dropped_records")
    for _ in range(LOSS_TRIES):
        step = _at_unit_gap(c, run_id)
        time.sleep(0.02)  # the writer has its answer: no retry brings the record back
        c.restart_redis()
        if any(_row(metrics, c, step)[k] for k in lost):
            return step
    raise AssertionError(f"{LOSS_TRIES} Redis restarts and no record lost")


def test_redis_restart_mid_step_records_are_regenerated(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """Redis restarts empty after a step's first unit wrote its records: the trainer finds
    that group's records missing for good and generates it again (stores.lost_records
    default), so every sample of the step is still trained, and the regeneration counted."""
    steps = 2 + LOSS_TRIES  # room for every try
    _start_run(cluster, tmp_path, "chaos-redis", steps, run=SLOW_UNITS)
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    lost_at = _restart_redis_between_units(cluster, "chaos-redis", tmp_path / "metrics.jsonl")
    final = _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")
    assert final["step"] == steps
    totals = _assert_every_sample_trained(tmp_path, steps)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[lost_at]["samples_regenerated"] >= GROUP_SIZE, rows[lost_at]
    assert totals["samples_unguided"] == 0, totals
    assert cluster.trainer is not None
    text = httpx.get(f"{cluster.trainer.http_url}/metrics", timeout=5).text
    assert f"trace_trainer_samples_regenerated_total {float(totals['samples_regenerated'])}" in text


def test_redis_restart_mid_step_records_trained_unguided(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """The same fault with stores.lost_records = "unguided": the group is trained without records
    (round-to-nearest QAT) and counted as unguided."""
    steps = 2 + LOSS_TRIES  # room for every try
    _start_run(
        cluster,
        tmp_path,
        "chaos-unguided",
        steps,
        run={"stores.lost_records": "unguided", **SLOW_UNITS},
    )
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    lost_at = _restart_redis_between_units(cluster, "chaos-unguided", tmp_path / "metrics.jsonl")
    _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")
    totals = _assert_every_sample_trained(tmp_path, steps)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[lost_at]["samples_unguided"] >= GROUP_SIZE, rows[lost_at]
    assert totals["samples_regenerated"] == 0, totals


def test_redis_memory_pressure_finishes_or_fails_loudly(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """Redis's maxmemory cut to about 4 records: a step's first records are evicted by
    its last ones before the trainer reads them. The lost groups are generated again; the run
    either finishes with every sample trained (the regenerations counted) or, where even
    they are evicted, fails loudly past stores.max_dropped_fraction (state failed, /healthz
    503, run_failed 1). It never reports finished with samples dropped."""
    steps = 6
    metrics = tmp_path / "metrics.jsonl"
    # any sample left untrained fails the run (the default tolerates half of them, and a step
    # whose regenerated records are evicted too stays under that on a loaded machine)
    _start_run(cluster, tmp_path, "chaos-memory", steps, run={"stores.max_dropped_fraction": 0})
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")  # every client has connected
    cluster.pause_trainer("chaos")
    cluster.settled_status()
    assert cluster.redis is not None
    admin = redis.Redis.from_url(cluster.redis.url)
    records = sum(admin.memory_usage(k) or 0 for k in admin.keys("trace:qc:chaos-memory:*"))
    # room for about 2 records (a step writes 8, a unit 4) on top of what is not a record, so
    # a unit's records evict each other even when the rest of Redis's memory shrinks a little;
    # a bound below one record refuses writes (OOM) instead, and the run fails loudly (the
    # other branch below; see the README's fault table)
    bound = int(admin.info("memory")["used_memory"]) - records + 3000
    admin.config_set("maxmemory", bound)
    cluster.resume_trainer()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    seen_step, bitten = 1, False
    while (st := cluster.trainer_status())["state"] not in ("finished", "failed"):
        assert time.monotonic() < deadline, st
        m = st.get("last_metrics") or {}
        bitten = bitten or bool(m.get("samples_regenerated") or m.get("samples_dropped_records"))
        if st["step"] > seen_step and not bitten:
            # a step went through whole (the least recently used records Redis evicted were
            # older steps'): tighten the bound until a step's own records are evicted
            seen_step, bound = st["step"], bound - 1000
            admin.config_set("maxmemory", bound)
        time.sleep(0.1)
    admin.close()
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one row per step"
    for r in rows:  # each sample trained or counted
        assert r["samples_trained"] + r["samples_dropped_records"] == r["samples"], r
    dropped = sum(r["samples_dropped_records"] for r in rows)
    assert cluster.trainer is not None
    healthz = httpx.get(f"{cluster.trainer.http_url}/healthz", timeout=5).status_code
    if st["state"] == "finished":
        totals = _assert_every_sample_trained(tmp_path, steps)
        assert totals["samples_regenerated"] > 0, "the memory bound never evicted a record"
        assert healthz == 200
    else:
        assert dropped > 0 and "stores.max_dropped_fraction" in st["detail"], (st, rows)
        assert healthz == 503
        text = httpx.get(f"{cluster.trainer.http_url}/metrics", timeout=5).text
        assert "trace_trainer_run_failed 1.0" in text


def test_redis_too_full_for_one_record_fails_the_run_loudly_and_soon(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """Redis's maxmemory cut below what it already holds: every record write is refused (OOM,
    RESOURCE_EXHAUSTED). Replicas send their completions back without records, the trainer
    regenerates the groups, those are refused too and dropped, and the run fails past
    stores.max_dropped_fraction within a step or two instead of retrying units for minutes."""
    metrics = tmp_path / "metrics.jsonl"
    _start_run(cluster, tmp_path, "chaos-full", 6)
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    cluster.pause_trainer("chaos")
    cluster.settled_status()
    assert cluster.redis is not None
    admin = redis.Redis.from_url(cluster.redis.url)
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) // 2)
    admin.close()
    t0 = time.monotonic()
    cluster.resume_trainer()
    st = _wait(cluster, lambda st: st["state"] in ("finished", "failed"), "the run's end")
    took = time.monotonic() - t0
    assert st["state"] == "failed" and "stores.max_dropped_fraction" in st["detail"], st
    assert took < 60.0, f"the run took {took:.0f} s to fail"
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one row per step"
    assert rows[-1]["samples_dropped_records"] == rows[-1]["samples"], rows[-1]
    assert cluster.trainer is not None
    assert httpx.get(f"{cluster.trainer.http_url}/healthz", timeout=5).status_code == 503


def test_replica_killed_mid_step_its_unit_is_generated_again(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """The only replica is killed while it generates a step's second unit and comes back
    empty: the unit goes back to the queue and the fresh replica (once it pulls the current
    version) generates it; nothing is lost or trained twice."""
    steps = 4
    metrics = tmp_path / "metrics.jsonl"
    _start_run(cluster, tmp_path, "chaos-replica", steps)
    _wait(cluster, lambda st: st["step"] >= 1, "step 1")
    killed_at = _at_unit_gap(cluster, "chaos-replica")
    cluster.restart_replica(0)
    final = _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")
    assert final["step"] == steps
    _assert_every_sample_trained(tmp_path, steps)
    row = read_metrics(metrics)[killed_at]
    assert row["redispatched_units"] >= 1 and row["failed_replicas"] == ["rollout-0"], row


def test_trainer_killed_mid_run_resumes_with_one_row_per_step(
    cluster: LocalCluster, tmp_path: pathlib.Path
) -> None:
    """The trainer is SIGKILLed mid-step, steps past its last checkpoint (every 3 steps). The
    restarted trainer resumes from that checkpoint and runs those steps again: metrics.jsonl
    ends with exactly one row per step (the rows after the checkpoint were removed), every
    sample of every step trained."""
    steps = 7
    metrics = tmp_path / "metrics.jsonl"
    env = {"TRACE_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    run = {"checkpoint.every": 3}
    _start_run(cluster, tmp_path, "chaos-trainer", steps, run=run, env=env)
    _wait(cluster, lambda _st: len(_rows(metrics)) >= 4, "step 4's row")
    assert cluster.trainer is not None
    cluster.trainer.kill()
    rows_at_kill = len(read_metrics(metrics))
    resumed_audit = tmp_path / "trainer-audit-resumed.jsonl"
    _start_run(cluster, tmp_path, "chaos-trainer", steps, stop=False, run=run,
               env={**env, "TRACE_RECORD_AUDIT_FILE": str(resumed_audit)})  # fmt: skip
    final = _wait(cluster, lambda st: st["state"] == "finished", "the end of the run")
    assert final["resumed_from"] and final["resumed_from"].endswith("step-000003"), final
    assert rows_at_kill > 3, rows_at_kill  # rows past the checkpoint existed: they were removed
    _assert_every_sample_trained(tmp_path, steps)
    # The resumed trainer trained only the steps after the checkpoint (sample ids s3-*, s4-*,
    # ...). Those may carry the same (version, id) as the killed trainer's when it died before
    # its next version reached weight-sync: the checkpoint's version is then kept, and the
    # step runs again with the same seeds. Steps up to the checkpoint never run twice.
    again = {a["sample_id"] for a in read_audit(resumed_audit)}
    assert again and all(int(sid.split("-")[0][1:]) >= 3 for sid in again), sorted(again)[:4]
