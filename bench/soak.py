"""The whole local system under load for a set time, with faults at random times.

The CPU debug shape runs as real processes (`LocalCluster`: Redis, quant-cache, weight-sync,
the trainer, `--replicas` rollout replicas). Besides the RL loop, client threads pull the
latest policy version from weight-sync and read records that the rollouts wrote from
quant-cache, timing every call. A seeded schedule injects one fault every `--fault-every`
seconds on average, cycling through the kinds in a shuffled order: a replica killed and
started again, Redis restarted empty, weight-sync restarted empty, the trainer SIGKILLed and
started again (it resumes from its latest checkpoint).

The report: samples lost and duplicated over the trained steps, per-RPC p50/p99 latency of
the clients, their errors by status code, each service's RSS after warm-up and at the end.
Targets: 0 lost, 0 duplicated, every service alive at the end, RSS growth under
`--max-memory-growth`; the exit code is 1 if one fails.

    python bench/soak.py --minutes 30 --replicas 3 --fault-every 60 --seed 0 --out soak.json

Samples are accounted by `trace_common.rl.audit.account_samples` from metrics.jsonl, each
trainer process's record audit and the rollouts' audit (its docstring says how).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import pathlib
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trace_common.clients import QuantCacheClient, WeightSyncClient  # noqa: E402
from trace_common.launch.cluster import ClusterConfig, LocalCluster  # noqa: E402
from trace_common.launch.plots import read_metrics  # noqa: E402
from trace_common.rl.audit import TrainerLife, account_samples  # noqa: E402
from trace_common.rl.checkpoint import latest_checkpoint  # noqa: E402

FAULTS = ("replica", "redis", "weight-sync", "trainer")
RUN_ID = "soak"
# The trainer's run: the chaos suite's small reverse task, as many steps as the time allows.
RUN = {
    "run_id": RUN_ID,
    "steps": 1_000_000,
    "task": {"name": "reverse", "difficulty": 2},
    "model.name": "debug",
    "prompts_per_step": 4,
    "group_size": 4,
    "dispatch.prompts_per_unit": 1,
    "checkpoint.every": 2,
}
MEMORY_EVERY_S = 2.0
TICK_S = 0.5
HEALTH_TIMEOUT_S = 15.0
RECENT_RECORDS = 512  # record keys the quant-cache clients choose from
RECORDS_PER_GET = 4
KEEP_CHECKPOINTS = 3  # the trainer resumes from the latest


@dataclass(kw_only=True, slots=True)
class SoakConfig:
    """One soak run."""

    minutes: float = 30.0  # load and faults for this long (after the system is up)
    replicas: int = 3
    fault_every_s: float = 60.0  # mean seconds between faults (each gap uniform in 0.5-1.5x)
    faults: tuple[str, ...] = FAULTS
    seed: int = 0
    weight_clients: int = 2  # threads pulling the latest version from weight-sync
    record_clients: int = 2  # threads reading records from quant-cache
    client_pause_s: float = 0.2  # each client thread's pause between calls
    # RSS is compared from this many seconds after a process started; None: a quarter of the
    # run, at most 5 minutes (the trainer's first steps allocate its optimizer state)
    warmup_s: float | None = None
    max_memory_growth: float = 0.10  # the RSS target, as a fraction of the warm-up RSS
    # not held to the RSS target (still reported): Redis grows by design, it keeps every
    # record for quant-cache's TTL (an hour by default) up to its maxmemory
    memory_exempt: tuple[str, ...] = ("redis",)
    workdir: pathlib.Path | None = None  # logs, metrics, audits; None: a new temp directory

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        if self.fault_every_s <= 0:
            raise ValueError(f"fault_every_s must be > 0, got {self.fault_every_s}")
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {list(FAULTS)}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(300.0, self.duration_s / 4)


# ---------------------------------------------------------------------------- client load


class CallLog:
    """Latency of every successful call and the failures by status code, per RPC (threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, list[float]] = collections.defaultdict(list)
        self.errors: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def timed(self, rpc: str, fn: Callable[[], Any]) -> Any:
        """`fn()` timed under `rpc`; a failure is counted by its code and returns None."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # every failure is a data point of the soak
            with self._lock:
                self.errors[rpc][status_code(exc)] += 1
            return None
        with self._lock:
            self.seconds[rpc].append(time.perf_counter() - t0)
        return out

    def error_total(self) -> int:
        with self._lock:
            return sum(sum(c.values()) for c in self.errors.values())

    def summary(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            rpcs = sorted(set(self.seconds) | set(self.errors))
            return {
                rpc: {
                    "calls": len(self.seconds[rpc]) + sum(self.errors[rpc].values()),
                    "ok": len(self.seconds[rpc]),
                    "p50_ms": percentile(self.seconds[rpc], 50) * 1e3,
                    "p99_ms": percentile(self.seconds[rpc], 99) * 1e3,
                    "errors": dict(self.errors[rpc]),
                }
                for rpc in rpcs
            }


def status_code(exc: BaseException) -> str:
    """A gRPC status code's name (also the data paths' errors that carry one), else the
    exception's type."""
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return code().name
        except Exception:  # an object whose code() is not a grpc.StatusCode
            pass
    return type(exc).__name__


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (NaN for no data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class RecentRecords:
    """The record keys the rollouts wrote most recently, read from their audit file as it
    grows (complete lines only)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._offset = 0
        self._lock = threading.Lock()
        self.keys: collections.deque[tuple[str, int, str]] = collections.deque(
            maxlen=RECENT_RECORDS
        )

    def refresh(self) -> None:
        with self._lock:
            if not self.path.exists():
                return
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offset += end
            for line in data[:end].splitlines():
                if line.strip():
                    a = json.loads(line)
                    self.keys.append((a["run_id"], a["version"], a["sample_id"]))

    def pick(self, rng: random.Random, n: int) -> tuple[str, int, list[str]] | None:
        """Up to `n` recent sample ids of one (run, version)."""
        with self._lock:
            if not self.keys:
                return None
            run_id, version, _ = rng.choice(self.keys)
            ids = [s for r, v, s in self.keys if (r, v) == (run_id, version)]
        return run_id, version, rng.sample(ids, min(n, len(ids)))


class ClientLoad:
    """Client threads beside the RL loop: weight-sync pulls and quant-cache record reads."""

    def __init__(self, cluster: LocalCluster, cfg: SoakConfig, records: RecentRecords) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.records = records
        self.calls = CallLog()
        self.records_missing = 0  # asked for, not returned (Redis restarted since, evicted)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        loops = [self._pull_loop] * self.cfg.weight_clients + [self._read_loop] * (
            self.cfg.record_clients
        )
        for i, loop in enumerate(loops):
            t = threading.Thread(target=loop, args=(i,), name=f"soak-client-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _pull_loop(self, i: int) -> None:
        assert self.cluster.weight_sync is not None
        ws = WeightSyncClient(self.cluster.weight_sync.grpc_address, self.cluster.config.token)
        try:
            while not self._stop.wait(self.cfg.client_pause_s):
                versions = self.calls.timed("weight-sync ListVersions", ws.versions)
                if versions:
                    latest = max(v.version for v in versions)
                    pull = functools.partial(ws.pull_version, latest, replica_id=f"soak-client-{i}")
                    self.calls.timed("weight-sync pull", pull)
        finally:
            ws.close()

    def _read_loop(self, i: int) -> None:
        assert self.cluster.quant_cache is not None
        qc = QuantCacheClient(self.cluster.quant_cache.grpc_address, self.cluster.config.token)
        rng = random.Random(self.cfg.seed * 1000 + i)
        try:
            while not self._stop.wait(self.cfg.client_pause_s):
                self.records.refresh()
                picked = self.records.pick(rng, RECORDS_PER_GET)
                if picked is None:
                    continue
                run_id, version, ids = picked
                get = functools.partial(qc.get_records, run_id, version, ids)
                got = self.calls.timed("quant-cache get_records", get)
                if got is not None:
                    self.records_missing += len(ids) - len(got)
        finally:
            qc.close()


# --------------------------------------------------------------------------------- faults


class Faults:
    """The seeded fault schedule and what each fault does to the cluster. A fault's "took_s"
    is how long the soak spent on it: the kill, and the restart until the new process
    answers (a replica: its ports; the others: grpc.health SERVING)."""

    def __init__(self, cluster: LocalCluster, cfg: SoakConfig, workdir: pathlib.Path) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.lives = [TrainerLife(audit=workdir / "trainer-audit-1.jsonl")]
        self.done: list[dict[str, Any]] = []
        self._order: list[str] = []
        self.next_at = self._gap()

    def _gap(self) -> float:
        return self.cfg.fault_every_s * self.rng.uniform(0.5, 1.5)

    def _next_kind(self) -> str:
        if not self._order:  # every kind once per round, in a shuffled order
            self._order = list(self.cfg.faults)
            self.rng.shuffle(self._order)
        return self._order.pop()

    def due(self, t: float) -> bool:
        return bool(self.cfg.faults) and t >= self.next_at

    def inject(self, t: float) -> dict[str, Any]:
        kind = self._next_kind()
        t0 = time.monotonic()
        try:
            detail, ok = getattr(self, "_" + kind.replace("-", "_"))(), True
        except Exception as exc:  # a service that does not come back: reported, soak goes on
            first = str(exc).splitlines()[0] if str(exc) else ""
            detail, ok = f"not recovered: {type(exc).__name__}: {first[:200]}", False
        event = {"t_s": round(t, 1), "fault": kind, "detail": detail, "recovered": ok,
                 "took_s": round(time.monotonic() - t0, 2)}  # fmt: skip
        self.done.append(event)
        self.next_at = t + (time.monotonic() - t0) + self._gap()
        return event

    def _replica(self) -> str:
        i = self.rng.randrange(len(self.cluster.rollouts))
        self.cluster.restart_replica(i)
        return f"rollout-{i}"

    def _redis(self) -> str:
        self.cluster.restart_redis()
        return "restarted empty"

    def _weight_sync(self) -> str:
        self.cluster.restart_weight_sync(down_s=0.5)
        return "restarted empty"

    def _trainer(self) -> str:
        assert self.cluster.trainer is not None
        self.cluster.trainer.kill()
        life = TrainerLife(audit=self.workdir / f"trainer-audit-{len(self.lives) + 1}.jsonl")
        self.lives.append(life)  # listed before it starts: whatever it trains is accounted
        self.cluster.start_trainer(wait=True, env={"TRACE_RECORD_AUDIT_FILE": str(life.audit)})
        resumed = self.cluster.trainer_status().get("resumed_from")
        life.resumed_step = int(resumed.rsplit("-", 1)[1]) if resumed else 0
        return f"resumed from step {life.resumed_step}"


# ----------------------------------------------------------------------------------- memory


@dataclass(kw_only=True, slots=True)
class MemorySamples:
    """RSS of every service process over time: name -> [(t, pid, rss bytes)]."""

    samples: dict[str, list[tuple[float, int, int]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )

    def take(self, t: float, pids: Mapping[str, int]) -> None:
        for name, pid in pids.items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue  # it exited between the listing and the read
            self.samples[name].append((t, pid, rss))

    def report(self, warmup_s: float) -> dict[str, dict[str, Any]]:
        """Per service: the RSS of its last process `warmup_s` after it started (first seen)
        and at the end, and the growth between them; "max_growth" is the largest such growth
        of any of its processes (one restarted by a fault included). A process that ended
        before `warmup_s` has no growth."""
        out = {}
        for name, xs in sorted(self.samples.items()):
            lives: dict[int, list[tuple[float, int, int]]] = {}
            for x in xs:
                lives.setdefault(x[1], []).append(x)
            growth = {pid: _growth(own, warmup_s) for pid, own in lives.items()}
            _, pid, end = xs[-1]
            judged = [g for g, _ in growth.values() if g is not None]
            out[name] = {
                "pid": pid,
                "restarts": len(lives) - 1,
                "started_s": round(lives[pid][0][0], 1),
                "start_rss_bytes": growth[pid][1],
                "end_rss_bytes": end,
                "growth": growth[pid][0],
                "max_growth": max(judged) if judged else None,
                "processes_judged": len(judged),
            }
        return out


def _growth(
    own: Sequence[tuple[float, int, int]], warmup_s: float
) -> tuple[float | None, int | None]:
    """(growth from the first sample `warmup_s` after the process was first seen to its last
    sample, that first RSS); (None, None) if it has no sample that late before its last."""
    warm = [x for x in own if x[0] >= own[0][0] + warmup_s]
    if not warm or warm[0][0] >= own[-1][0]:
        return None, None
    start = warm[0][2]
    return (own[-1][2] - start) / start, start


def server_rpcs(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """Each service's own view of the gRPC calls it served (its running process: counters
    start again with a restart), from its /metrics: calls and codes of
    `trace_<svc>_grpc_requests_total`, and p50/p99 of `trace_<svc>_grpc_request_seconds` as the
    upper bound of the histogram bucket the quantile falls in."""
    out: dict[str, dict[str, Any]] = {}
    for svc in [cluster.quant_cache, cluster.weight_sync, cluster.trainer, *cluster.rollouts]:
        assert svc is not None
        try:
            text = httpx.get(f"{svc.http_url}/metrics", timeout=HEALTH_TIMEOUT_S).text
        except httpx.HTTPError:
            continue  # not answering: `alive` reports it
        buckets: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        codes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                method = sample.labels.get("method", "").rsplit("/", 1)[-1]
                if sample.name.endswith("_grpc_request_seconds_bucket"):
                    buckets[method].append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_grpc_requests_total"):
                    codes[method][sample.labels["code"]] += int(sample.value)
        for method, bs in buckets.items():
            bs.sort()
            out[f"{svc.name} {method}"] = {
                "calls": int(bs[-1][1]),
                "p50_le_ms": _bucket_quantile(bs, 0.50) * 1e3,
                "p99_le_ms": _bucket_quantile(bs, 0.99) * 1e3,
                "codes": dict(codes[method]),
            }
    return out


def _bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The upper bound of the first cumulative bucket holding a fraction `q` of the calls."""
    total = buckets[-1][1]
    if not total:
        return float("nan")
    return next(le for le, n in buckets if n >= q * total)


# ------------------------------------------------------------------------------------- run


def alive(cluster: LocalCluster) -> dict[str, bool]:
    """Every service's process runs and answers grpc.health SERVING (Redis: PING); the
    trainer has not failed."""
    out = {}
    for svc in [cluster.quant_cache, cluster.weight_sync, cluster.trainer, *cluster.rollouts]:
        assert svc is not None
        try:
            svc.wait_serving(timeout=HEALTH_TIMEOUT_S)
            out[svc.name] = svc.alive()
        except RuntimeError:
            out[svc.name] = False
    st = _status_or_none(cluster)
    out["trainer"] = out["trainer"] and st is not None and st["state"] != "failed"
    assert cluster.redis is not None
    client = redis.Redis.from_url(cluster.redis.url, socket_timeout=5)
    try:
        out["redis"] = bool(client.ping())
    except redis.RedisError:
        out["redis"] = False
    finally:
        client.close()
    return out


def cluster_config(cfg: SoakConfig, workdir: pathlib.Path) -> ClusterConfig:
    return ClusterConfig(
        replicas=cfg.replicas,
        heartbeat_timeout_s=2.0,
        run=RUN,
        trainer_env={
            "TRACE_METRICS_FILE": str(workdir / "metrics.jsonl"),
            "TRACE_CHECKPOINT_DIR": str(workdir / "ckpt"),
            "TRACE_RECORD_AUDIT_FILE": str(workdir / "trainer-audit-1.jsonl"),
        },
        rollout_env={
            "TRACE_HEARTBEAT_INTERVAL_SECONDS": "0.5",
            "TRACE_RECORD_AUDIT_FILE": str(workdir / "rollout-audit.jsonl"),
        },
    )


@dataclass(kw_only=True, slots=True)
class Running:
    """What the main loop holds while the soak runs."""

    cluster: LocalCluster
    load: ClientLoad
    faults: Faults
    memory: MemorySamples = field(default_factory=MemorySamples)


@contextlib.contextmanager
def clients_log(path: pathlib.Path) -> Iterator[None]:
    """This process's log lines (the clients' retries while a service restarts) go to `path`,
    not under the progress bar."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()


def soak(cfg: SoakConfig, console: Console) -> dict[str, Any]:
    """Start the system, load it and inject faults for `cfg.minutes`, then report."""
    workdir = cfg.workdir or pathlib.Path(tempfile.mkdtemp(prefix="trace-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"soak: starting the local system in {workdir}")
    t_boot = time.monotonic()
    with (
        clients_log(workdir / "soak-clients.log"),
        LocalCluster(cluster_config(cfg, workdir), workdir / "logs") as cluster,
    ):
        boot_s = time.monotonic() - t_boot
        run = Running(
            cluster=cluster,
            load=ClientLoad(cluster, cfg, RecentRecords(workdir / "rollout-audit.jsonl")),
            faults=Faults(cluster, cfg, workdir),
        )
        run.load.start()
        try:
            _loop(run, cfg, console)
        finally:
            run.load.stop()
        # a trainer that failed refuses the pause; its state is in the report
        with contextlib.suppress(grpc.RpcError):
            cluster.pause_trainer("soak finished")
        try:
            final = cluster.settled_status()
        except httpx.HTTPError:  # no trainer answering: account the steps it wrote
            final = {"step": None, "state": "unreachable"}
        up = alive(cluster)
        served = server_rpcs(cluster)
        run.memory.take(cfg.duration_s, cluster.processes())
    report = build_report(cfg, run, workdir, final, up)
    report["boot_s"] = round(boot_s, 1)
    report["server_rpcs"] = served
    return report


def build_report(
    cfg: SoakConfig, run: Running, workdir: pathlib.Path, final: dict, up: dict[str, bool]
) -> dict[str, Any]:
    """The soak's measurements and targets, from the run directory and what `run` held."""
    rows = read_metrics(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    steps = (
        final["step"] if final["step"] is not None else max((r["step"] for r in rows), default=0)
    )
    samples = account_samples(
        rows, run.faults.lives, workdir / "rollout-audit.jsonl", steps=steps,
        prompts_per_step=RUN["prompts_per_step"], group_size=RUN["group_size"],
    )  # fmt: skip
    step_s = [r["step_time_s"] for r in rows if r["step"] <= steps]
    memory = run.memory.report(cfg.warmup)
    growth = {n: m["max_growth"] for n, m in memory.items() if m["max_growth"] is not None}
    targets = {
        "0 samples lost": samples["lost"] == 0,
        "0 samples duplicated": samples["duplicated"] == 0,
        "0 trained records unmatched": samples["unmatched"] == 0,
        "0 trained samples unaudited": samples["unaudited"] == 0,
        "every service alive": all(up.values()),
        "every fault recovered": all(f["recovered"] for f in run.faults.done),
        f"RSS growth < {cfg.max_memory_growth:.0%}": all(
            g < cfg.max_memory_growth for n, g in growth.items() if n not in cfg.memory_exempt
        ),
        "steps trained": steps > 0,
    }
    return {
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        "workdir": str(workdir),
        "warmup_s": cfg.warmup,
        "steps": steps,
        "step_time_p50_s": percentile(step_s, 50),
        "step_time_p99_s": percentile(step_s, 99),
        "trainer_state": final["state"],
        "faults": run.faults.done,
        "samples": samples,
        "records_missing_for_clients": run.load.records_missing,
        "rpcs": run.load.calls.summary(),
        "memory": memory,
        "alive": up,
        "targets": targets,
        "passed": all(targets.values()),
    }


def _loop(run: Running, cfg: SoakConfig, console: Console) -> None:
    """Until the time is up: sample memory, inject the faults that are due, show progress."""
    columns = [TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn()]
    t0 = time.monotonic()
    next_memory = 0.0
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("soak", total=cfg.duration_s)
        for t in _ticks(t0, cfg.duration_s):
            if t >= next_memory:
                run.memory.take(t, run.cluster.processes())
                next_memory = t + MEMORY_EVERY_S
                prune_checkpoints(run.faults.workdir / "ckpt")
            if run.faults.due(t):
                event = run.faults.inject(t)
                progress.console.print(f"[{event['t_s']:7.1f}s] fault {event['fault']}: "
                                       f"{event['detail']} ({event['took_s']} s)")  # fmt: skip
            st = _status_or_none(run.cluster)
            step = "?" if st is None else f"{st['step']} ({st['state']})"
            progress.update(task, completed=min(t, cfg.duration_s), description=(
                f"step {step}  faults {len(run.faults.done)}  "
                f"client errors {run.load.calls.error_total()}"))  # fmt: skip


def prune_checkpoints(root: pathlib.Path, keep: int = KEEP_CHECKPOINTS) -> None:
    """Remove all but the newest `keep` checkpoints (never the one `latest` names): the
    trainer keeps every one, a few MiB each in the debug shape, and a long soak writes
    thousands."""
    if not root.is_dir():
        return
    current = latest_checkpoint(root)
    for path in sorted(root.glob("step-*"))[:-keep]:
        if path != current:
            shutil.rmtree(path, ignore_errors=True)


def _ticks(t0: float, duration_s: float) -> Iterator[float]:
    while (t := time.monotonic() - t0) < duration_s:
        yield t
        time.sleep(TICK_S)


def _status_or_none(cluster: LocalCluster) -> dict | None:
    try:
        return cluster.trainer_status()
    except Exception:  # the trainer restarting: no status this tick
        return None


# ---------------------------------------------------------------------------------- output


def print_report(report: dict[str, Any], console: Console) -> None:
    s = report["samples"]
    summary = Table(title=f"soak: {report['steps']} steps, {len(report['faults'])} faults")
    summary.add_column("measure")
    summary.add_column("value", justify="right")
    for k in ("expected", "trained", "lost", "duplicated", "unmatched", "unaudited", "regenerated",
              "records_audited", "rollout_records_written"):  # fmt: skip
        summary.add_row(f"samples {k}", str(s[k]))
    summary.add_row("step time p50 / p99 (s)",
                    f"{report['step_time_p50_s']:.2f} / {report['step_time_p99_s']:.2f}")  # fmt: skip
    faults = collections.Counter(f["fault"] for f in report["faults"])
    summary.add_row("faults", ", ".join(f"{k} {n}" for k, n in sorted(faults.items())) or "none")
    console.print(summary)

    rpcs = Table(title="client RPCs")
    for col in ("rpc", "calls", "ok", "p50 ms", "p99 ms", "errors by code"):
        rpcs.add_column(col, justify="left" if col in ("rpc", "errors by code") else "right")
    for rpc, r in report["rpcs"].items():
        errors = ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "-"
        rpcs.add_row(rpc, str(r["calls"]), str(r["ok"]), f"{r['p50_ms']:.1f}",
                     f"{r['p99_ms']:.1f}", errors)  # fmt: skip
    console.print(rpcs)

    served = Table(
        title="RPCs as each service counted them (its last process; p50/p99: bucket bound)"
    )
    for col in ("service method", "calls", "p50 ms <=", "p99 ms <=", "codes"):
        served.add_column(col, justify="left" if col in ("service method", "codes") else "right")
    for name, r in report.get("server_rpcs", {}).items():
        codes = ", ".join(f"{c} {n}" for c, n in sorted(r["codes"].items()))
        served.add_row(name, str(r["calls"]), f"{r['p50_le_ms']:g}", f"{r['p99_le_ms']:g}", codes)
    console.print(served)

    mem = Table(title=f"RSS of the last process ({report['warmup_s']:.0f} s after it started, "
                "and at the end); max growth: of any of the service's processes")  # fmt: skip
    for col in ("service", "restarts", "start MiB", "end MiB", "growth", "max growth", "alive"):
        mem.add_column(col, justify="left" if col == "service" else "right")
    for name, m in report["memory"].items():
        start = "-" if m["start_rss_bytes"] is None else f"{m['start_rss_bytes'] / 2**20:.1f}"
        growth, most = (
            "too young" if g is None else f"{g:+.1%}" for g in (m["growth"], m["max_growth"])
        )
        shown = f"{name} (not judged)" if name in report["config"]["memory_exempt"] else name
        mem.add_row(shown, str(m["restarts"]), start, f"{m['end_rss_bytes'] / 2**20:.1f}",
                    growth, most, str(report["alive"].get(name, "?")))  # fmt: skip
    console.print(mem)

    targets = Table(title="targets")
    targets.add_column("target")
    targets.add_column("result")
    for name, ok in report["targets"].items():
        targets.add_row(name, "[green]pass[/]" if ok else "[red]FAIL[/]")
    console.print(targets)


def parse_args(argv: Sequence[str] | None) -> tuple[SoakConfig, pathlib.Path | None]:
    d = SoakConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=d.minutes)
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument("--fault-every", type=float, default=d.fault_every_s,
                    help="mean seconds between faults")  # fmt: skip
    ap.add_argument("--faults", default=",".join(d.faults),
                    help=f"comma-separated kinds of {list(FAULTS)}; empty: none")  # fmt: skip
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--weight-clients", type=int, default=d.weight_clients)
    ap.add_argument("--record-clients", type=int, default=d.record_clients)
    ap.add_argument("--client-pause", type=float, default=d.client_pause_s)
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds after a process starts before its RSS baseline "
                         "(default: a quarter of the run, at most 300)")  # fmt: skip
    ap.add_argument("--max-memory-growth", type=float, default=d.max_memory_growth)
    ap.add_argument("--memory-exempt", default=",".join(d.memory_exempt),
                    help="comma-separated services not held to the RSS target")  # fmt: skip
    ap.add_argument("--workdir", type=pathlib.Path, default=None)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="the report as JSON")
    a = ap.parse_args(argv)
    cfg = SoakConfig(
        minutes=a.minutes, replicas=a.replicas, fault_every_s=a.fault_every,
        faults=tuple(f for f in a.faults.split(",") if f), seed=a.seed,
        weight_clients=a.weight_clients, record_clients=a.record_clients,
        client_pause_s=a.client_pause, warmup_s=a.warmup,
        max_memory_growth=a.max_memory_growth, workdir=a.workdir,
        memory_exempt=tuple(n for n in a.memory_exempt.split(",") if n),
    )  # fmt: skip
    return cfg, a.out


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 132)  # a log: no wrapped tables
    report = soak(cfg, console)
    print_report(report, console)
    if out is not None:
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"report: {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
