"""Prometheus files through promtool (Debian's `prometheus` package; `make test` installs it):
`check config`, `check rules`, and `test rules` with synthetic series so each alert is shown
to fire when it should and stay quiet when it should not."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
RULES = ROOT / "deploy/prometheus/rules/trace.rules.yml"
PROMTOOL_TIMEOUT_S = 60


def promtool() -> str:
    """Path of promtool; a missing promtool fails the test (it must not pass by skipping)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `apt-get install -y prometheus` (Debian ships promtool)")
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S
    )


def test_check_config() -> None:
    res = run("check", "config", str(CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 rule files found" in res.stdout + res.stderr


def test_check_rules() -> None:
    res = run("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_catches_a_broken_rule(tmp_path: pathlib.Path) -> None:
    """The check above can fail: a rule with a PromQL syntax error is rejected."""
    broken = tmp_path / "broken.yml"
    broken.write_text(RULES.read_text().replace("> 2", "> > 2", 1))
    assert run("check", "rules", str(broken)).returncode != 0


REPLICA_A = "10.0.0.2:8053"  # goes down and stops pulling weights
REPLICA_B = "10.0.0.3:8053"  # healthy
ID_A, ID_B = "rollout-a", "rollout-b"  # their replica ids on weight-sync


def _alert(name: str, at: str, alerts: list[dict]) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": alerts}


def test_alert_rules_fire(tmp_path: pathlib.Path) -> None:
    lag_annotations = {
        "summary": f"rollout replica {ID_A} lags 9 versions behind the trainer",
        "description": "The replica is not pulling new policy versions; its samples will be dropped as stale.",
    }
    cases = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'up{{job="trace-rollout",instance="{REPLICA_A}"}}',
                        "values": "1 1 0x10",
                    },
                    {
                        "series": f'up{{job="trace-rollout",instance="{REPLICA_B}"}}',
                        "values": "1x12",
                    },
                    {"series": 'up{job="trace-trainer",instance="trainer:8054"}', "values": "1x12"},
                    # weight-sync's per-replica lag: A stuck at version 0 while versions advance.
                    {
                        "series": f'trace_weight_sync_replica_version_lag{{job="trace-weight-sync",replica_id="{ID_A}"}}',
                        "values": "0+1x12",
                    },
                    {
                        "series": f'trace_weight_sync_replica_version_lag{{job="trace-weight-sync",replica_id="{ID_B}"}}',
                        "values": "0x12",
                    },
                    {
                        "series": 'trace_trainer_logp_abs_diff_mean{job="trace-trainer",instance="trainer:8054"}',
                        "values": "0.01x2 0.2x9",
                    },
                    # the run fails at 5m
                    {
                        "series": 'trace_trainer_run_failed{job="trace-trainer",instance="trainer:8054"}',
                        "values": "0x4 1x7",
                    },
                ],
                "alert_rule_test": [
                    # Down at 2m; `for: 1m` -> firing from 3m, only for replica A.
                    _alert("TraceRolloutReplicaDown", "1m", []),
                    _alert(
                        "TraceRolloutReplicaDown",
                        "4m",
                        [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "trace-rollout",
                                    "instance": REPLICA_A,
                                },
                                "exp_annotations": {
                                    "summary": f"rollout replica {REPLICA_A} is down",
                                    "description": f"Prometheus could not scrape rollout replica {REPLICA_A} for 1 minute.",
                                },
                            }
                        ],
                    ),
                    _alert("TraceNoRolloutReplicas", "10m", []),
                    _alert("TraceServiceDown", "10m", []),
                    # Replica A's lag grows 1/min: > 2 from 3m, `for: 5m` -> firing at 9m (lag 9).
                    _alert("TraceRolloutVersionLag", "7m", []),
                    _alert(
                        "TraceRolloutVersionLag",
                        "9m",
                        [
                            {
                                "exp_labels": {"severity": "warning", "replica_id": ID_A},
                                "exp_annotations": lag_annotations,
                            }
                        ],
                    ),
                    # The failed run alerts at once (no `for`: a failed run does not recover).
                    _alert("TraceTrainerRunFailed", "4m", []),
                    _alert(
                        "TraceTrainerRunFailed",
                        "5m",
                        [
                            {
                                "exp_labels": {
                                    "severity": "critical",
                                    "job": "trace-trainer",
                                    "instance": "trainer:8054",
                                },
                                "exp_annotations": {
                                    "summary": "the trainer's run failed (trainer:8054)",
                                    "description": "The trainer stopped stepping (state failed; /healthz answers 503): see detail on its /status, e.g. too many samples dropped untrained (the recipe's stores.max_dropped_fraction).",
                                },
                            }
                        ],
                    ),
                    # Mismatch 0.2 > 0.05 from 3m, `for: 5m` -> firing at 8m, not at 7m.
                    _alert("TraceLogprobMismatchHigh", "7m", []),
                    _alert(
                        "TraceLogprobMismatchHigh",
                        "8m",
                        [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": {
                                    "summary": "train/rollout mean |dlogp| is 0.2",
                                    "description": "The trainer's log-probs drift from the rollout's (threshold 0.05 nats/token): check that guidance records reach the trainer.",
                                },
                            }
                        ],
                    ),
                ],
                "promql_expr_test": [
                    {
                        "expr": "trace:rollout_version_lag:by_replica",
                        "eval_time": "5m",
                        "exp_samples": [
                            {
                                "labels": f'trace:rollout_version_lag:by_replica{{replica_id="{ID_A}"}}',
                                "value": 5,
                            },
                            {
                                "labels": f'trace:rollout_version_lag:by_replica{{replica_id="{ID_B}"}}',
                                "value": 0,
                            },
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "trace.rules.test.yml"
    path.write_text(yaml.safe_dump(cases, sort_keys=False))
    res = run("test", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr
