"""Build the Grafana dashboard of a TRACE RL run from a short panel list.

The JSON that Grafana (compose provisioning) and the Helm chart (sidecar ConfigMap) load is
generated from `PANELS` below, so the queries live in one readable place:

    .venv/bin/python deploy/grafana/dashboard.py          # rewrite both JSON copies
    .venv/bin/python deploy/grafana/dashboard.py --check  # exit 1 if they are stale

Every query names only metrics the services export (tests/integration/deploy checks each one
returns data from a real Prometheus scraping the services).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTPUTS = (
    ROOT / "deploy/grafana/dashboards/trace-rl.json",
    ROOT / "charts/trace/files/trace-rl.json",
)
UID = "trace-rl-run"
TITLE = "TRACE RL run"
GRID_WIDTH = 24  # Grafana's dashboard grid is 24 columns wide
PANEL_HEIGHT = 8
RATE = "$__rate_interval"  # Grafana picks a window >= 4 scrape intervals


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target and its legend (`{{label}}` is filled per series)."""

    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    """A time-series (or stat) panel; `width` in grid columns."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 12
    kind: str = "timeseries"
    stack: bool = False


@dataclass(frozen=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


# Template variables: every query is scoped to the chosen namespace(s) and job(s), and the
# trainer's series to the trainer(s) of the chosen run(s) (`trace_trainer_run_info{run_id}`
# names each trainer's run; the hidden `trainer` variable holds their instances). "All" is
# `.*`, which also matches a series without the label (compose has no `namespace`).
SCOPE = 'namespace=~"$namespace", job=~"$job"'
TRAINER_SCOPE = f'{SCOPE}, instance=~"$trainer"'
METRIC = re.compile(r"\b(trace_[a-z0-9_]+|up)\b(\{[^}]*\})?(?!\()")


def scoped(expr: str) -> str:
    """`expr` with the template variables' selector added to every series it reads."""

    def add(m: re.Match[str]) -> str:
        name, labels = m.group(1), (m.group(2) or "{}")[1:-1]
        scope = TRAINER_SCOPE if name.startswith("trace_trainer_") else SCOPE
        return f"{name}{{{scope}{', ' + labels if labels else ''}}}"

    return METRIC.sub(add, expr)


def q(expr: str, legend: str) -> Query:
    return Query(scoped(" ".join(expr.split())), legend)


def _variable(name: str, label: str, query: str, *, hide: int = 0) -> dict:
    """A query variable over the Prometheus datasource: multi-select, All = `.*`."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,  # on time range change: a new run shows up
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": hide,
    }


VARIABLES = (
    _variable("namespace", "Namespace", 'label_values(up{job=~".*trace.*"}, namespace)'),
    _variable("job", "Job", 'label_values(up{namespace=~"$namespace", job=~".*trace.*"}, job)'),
    _variable(
        "run", "Run", 'label_values(trace_trainer_run_info{namespace=~"$namespace"}, run_id)'
    ),
    _variable(
        "trainer",
        "Trainer",
        'label_values(trace_trainer_run_info{namespace=~"$namespace", run_id=~"$run"}, instance)',
        hide=2,  # derived from the run
    ),
)


# Which service exports each family: trace_<component>_... with component rollout, trainer,
# weight_sync or quant_cache. Rollout series carry the scrape `instance` label (one per
# replica); weight-sync's per-replica series carry `replica_id`.
ROWS: tuple[Row, ...] = (
    Row(
        "Rollout",
        (
            Panel(
                "Rollout tokens/s per replica",
                "Generated (completion) tokens per second of each rollout replica.",
                "tokens/s",
                (
                    q(
                        f"sum by (instance) (rate(trace_rollout_generated_tokens_total[{RATE}]))",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Rollout tokens/s, all replicas",
                "Total generation throughput, and the rollout replicas Prometheus scrapes.",
                "tokens/s",
                (
                    q(f"sum(rate(trace_rollout_generated_tokens_total[{RATE}]))", "total"),
                    q('count(up{job="trace-rollout"} == 1)', "replicas up"),
                ),
            ),
            Panel(
                "Generate requests in flight",
                "Generate calls each replica is serving right now.",
                "short",
                (q("sum by (instance) (trace_rollout_requests_in_flight)", "{{instance}}"),),
            ),
            Panel(
                "Completions per second",
                "Completions finished per second, by replica.",
                "short",
                (
                    q(
                        f"sum by (instance) (rate(trace_rollout_completions_total[{RATE}]))",
                        "{{instance}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Policy weights",
        (
            Panel(
                "Weight version per replica",
                "Latest complete version on weight-sync (the trainer's last push) and the "
                "version each registered replica reports holding.",
                "short",
                (
                    q("max(trace_weight_sync_latest_version)", "latest (trainer)"),
                    q(
                        "scalar(max(trace_weight_sync_latest_version))"
                        " - max by (replica_id) (trace_weight_sync_replica_version_lag)",
                        "{{replica_id}}",
                    ),
                ),
            ),
            Panel(
                "Version lag behind the trainer",
                "Latest version minus the version each replica holds; live replicas.",
                "short",
                (
                    q(
                        "max by (replica_id) (trace_weight_sync_replica_version_lag)",
                        "{{replica_id}}",
                    ),
                    q("max(trace_weight_sync_replicas_alive)", "replicas alive"),
                ),
            ),
            Panel(
                "Weight push / pull seconds",
                "Mean seconds per version push (trainer to weight-sync) and per pull (replica), and "
                "each replica's last pull as the trainer saw it.",
                "s",
                (
                    q(
                        f"sum(rate(trace_weight_sync_push_seconds_sum[{RATE}]))"
                        f" / sum(rate(trace_weight_sync_push_seconds_count[{RATE}]))",
                        "push",
                    ),
                    q(
                        f"sum(rate(trace_weight_sync_pull_seconds_sum[{RATE}]))"
                        f" / sum(rate(trace_weight_sync_pull_seconds_count[{RATE}]))",
                        "pull",
                    ),
                    q(
                        "max by (replica_id) (trace_trainer_weight_pull_seconds)",
                        "last pull {{replica_id}}",
                    ),
                ),
            ),
            Panel(
                "Weight bytes pushed / pulled",
                "Bytes per second into weight-sync (published pushes) and out to each replica.",
                "Bps",
                (
                    q(f"sum(rate(trace_weight_sync_push_bytes_total[{RATE}]))", "pushed"),
                    q(
                        f"sum by (replica_id) (rate(trace_weight_sync_pull_bytes_total[{RATE}]))",
                        "pulled by {{replica_id}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Records and quant-cache",
        (
            Panel(
                "Record bytes per token",
                "Guidance + routing record bytes written per generated token, by replica.",
                "bytes",
                (
                    q(
                        f"sum by (instance) (rate(trace_rollout_record_bytes_total[{RATE}]))"
                        f" / sum by (instance) (rate(trace_rollout_generated_tokens_total[{RATE}]))",
                        "{{instance}}",
                    ),
                ),
                width=8,
            ),
            Panel(
                "quant-cache hits / misses / evictions",
                "Record lookups through the service that found a valid record, none, or a "
                "corrupt one; keys Redis evicted at its memory bound and expired by TTL. Counted "
                "in Redis, so every quant-cache replica reports the same value: max, not sum. "
                "Swept: record keys the service's sweep fixed or deleted (written past its TTL or "
                "size limit), per replica: sum.",
                "ops",
                (
                    q(f"max(rate(trace_quant_cache_hits_total[{RATE}]))", "hits"),
                    q(f"max(rate(trace_quant_cache_misses_total[{RATE}]))", "misses"),
                    q(f"max(rate(trace_quant_cache_corrupt_records_total[{RATE}]))", "corrupt"),
                    q(f"max(rate(trace_quant_cache_redis_evicted_keys_total[{RATE}]))", "evicted"),
                    q(f"max(rate(trace_quant_cache_redis_expired_keys_total[{RATE}]))", "expired"),
                    q(
                        f"sum by (action) (rate(trace_quant_cache_swept_records_total[{RATE}]))",
                        "swept: {{action}}",
                    ),
                ),
                width=8,
            ),
            Panel(
                "quant-cache bytes in / out, Redis memory",
                "Record bytes stored and returned per second; Redis used memory against maxmemory.",
                "bytes",
                (
                    q(f"max(rate(trace_quant_cache_put_bytes_total[{RATE}]))", "put /s"),
                    q(f"max(rate(trace_quant_cache_got_bytes_total[{RATE}]))", "get /s"),
                    q("max(trace_quant_cache_redis_used_memory_bytes)", "redis used"),
                    q("max(trace_quant_cache_redis_maxmemory_bytes)", "redis maxmemory"),
                ),
                width=8,
            ),
        ),
    ),
    Row(
        "Learning",
        (
            Panel(
                "Reward mean",
                "Mean verifier reward of the samples trained on, per step.",
                "short",
                (q("max(trace_trainer_reward_mean)", "reward"),),
                width=6,
            ),
            Panel(
                "Staleness",
                "Policy-version gap between the sampling and the trained policy (mean, max).",
                "short",
                (
                    q("max(trace_trainer_staleness_mean)", "mean"),
                    q("max(trace_trainer_staleness_max)", "max"),
                ),
                width=6,
            ),
            Panel(
                "Dropped samples, refused records",
                "Samples dropped per second for exceeding the staleness bound, and guidance "
                "records the trainer refused per second by their HMAC tag or CRC-32.",
                "short",
                (
                    q(
                        f"sum(rate(trace_trainer_samples_dropped_stale_total[{RATE}]))",
                        "dropped/s",
                    ),
                    q(
                        f"sum by (reason) (rate(trace_trainer_records_refused_total[{RATE}]))",
                        "records refused/s: {{reason}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Policy loss, clip fraction, IS weight",
                "Policy loss, fraction of tokens on the clipped branch, mean truncated "
                "importance weight.",
                "short",
                (
                    q("max(trace_trainer_loss)", "loss"),
                    q("max(trace_trainer_clip_frac)", "clip fraction"),
                    q("max(trace_trainer_tis_mean)", "TIS mean"),
                ),
                width=6,
            ),
        ),
    ),
    Row(
        "Held-out evaluation and rewards",
        (
            Panel(
                "Held-out reward, pass@1, pass@k",
                "The last held-out evaluation on the rollout replicas (FP4 rollout path): "
                "mean reward, fraction of completions that pass, fraction of prompts with a "
                "passing completion among k (the recipe's eval.every; 0 until the first).",
                "percentunit",
                (
                    q("max(trace_trainer_eval_reward_mean)", "mean reward"),
                    q("max(trace_trainer_eval_pass_at_1)", "pass@1"),
                    q("max(trace_trainer_eval_pass_at_k)", "pass@k"),
                ),
                width=12,
            ),
            Panel(
                "Reward failures, truncated completions, skipped prompts",
                "Per second: reward calls that raised or timed out (scored 0), completions cut "
                "off at max_new_tokens, dataset rows skipped (prompt too long or malformed).",
                "short",
                (
                    q(
                        f"sum by (reason) (rate(trace_trainer_reward_failures_total[{RATE}]))",
                        "reward {{reason}}",
                    ),
                    q(
                        f"sum(rate(trace_trainer_completions_truncated_total[{RATE}]))",
                        "truncated",
                    ),
                    q(
                        f"sum by (reason) (rate(trace_trainer_prompts_skipped_total[{RATE}]))",
                        "skipped {{reason}}",
                    ),
                ),
                width=12,
            ),
        ),
    ),
    Row(
        "Train / rollout discrepancy",
        (
            Panel(
                "Mean |dlogp|",
                "Mean and max |logp_train - logp_rollout| per token.",
                "short",
                (
                    q("max(trace_trainer_logp_abs_diff_mean)", "mean |dlogp|"),
                    q("max(trace_trainer_logp_abs_diff_max)", "max |dlogp|"),
                ),
                width=6,
            ),
            Panel(
                "k3 KL (rollout || trainer)",
                "k3 estimator of the KL between the rollout and trainer policies.",
                "short",
                (q("max(trace_trainer_k3_kl)", "k3 KL"),),
                width=6,
            ),
            Panel(
                "D_act per layer",
                "Activation discrepancy ||Q_train - Q_rollout||_F / ||Q_rollout||_F at guided "
                "sites (max over the sites of a layer; needs full guidance records).",
                "percentunit",
                (q("max by (layer) (trace_trainer_d_act)", "layer {{layer}}"),),
                width=6,
            ),
            Panel(
                "Code flips, routing mismatch",
                "Fraction of guided-site elements whose FP4 code differs from the rollout's, and "
                "of tokens whose top-k experts differ from the rollout's.",
                "percentunit",
                (
                    q("max(trace_trainer_code_flip_rate)", "code flip rate"),
                    q("max(trace_trainer_routing_mismatch)", "routing mismatch"),
                ),
                width=6,
            ),
        ),
    ),
    Row(
        "Step time",
        (
            Panel(
                "Step time split",
                "Seconds of the last step spent in rollout, records, train and push.",
                "s",
                (q("max by (phase) (trace_trainer_step_phase_seconds)", "{{phase}}"),),
                width=24,
                stack=True,
            ),
        ),
    ),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if panel.stack:
        custom |= {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": True,
            }
            for i, t in enumerate(panel.queries)
        ],
    }


def build() -> dict:
    """The dashboard JSON model (Grafana 10/11 schema)."""
    panels: list[dict] = []
    next_id = 1
    y = 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            panels.append(_panel_json(panel, next_id, x, y))
            next_id += 1
            x += panel.width
        y += PANEL_HEIGHT
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Throughput, weight sync, records and train/rollout discrepancy of a TRACE run.",
        "tags": ["trace", "rl", "fp4"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                *VARIABLES,
            ]
        },
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a JSON copy is stale")
    args = parser.parse_args()
    text = render()
    stale = [p for p in OUTPUTS if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(
                f"stale: {p.relative_to(ROOT)} (run deploy/grafana/dashboard.py)", file=sys.stderr
            )
        return 1 if stale else 0
    for p in OUTPUTS:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
