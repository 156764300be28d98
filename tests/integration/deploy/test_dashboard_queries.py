"""Every PromQL query of the Grafana dashboard returns data from a real Prometheus.

The four services run as real subprocesses through the containers' entry point
(`trace-rl serve <name>`), with a real Redis: the trainer runs a short RL run of the tiny
model with two rollout replicas (weights pushed and pulled every step, records written and
read). A real Prometheus server (Debian's `prometheus` binary) scrapes every /metrics on
loopback each second and evaluates the project's rules file. Meanwhile a probe puts and reads
records of its own run on quant-cache (one missing, one corrupted in Redis), and after the RL
run it floods quant-cache until Redis evicts at its memory bound.

Then each dashboard query is run as Grafana runs it, as a range query over the test's time
span: every query of every panel must return at least one finite sample, and every `trace_*`
metric a panel names must be exported by a service.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis
import yaml

from trace_common.clients import QuantCacheClient
from trace_common.clients.quant_cache import CorruptRecordError
from trace_common.service.process import LocalService
from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig, free_port

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy/grafana/dashboards/trace-rl.json"
RULES = ROOT / "deploy/prometheus/rules/trace.rules.yml"
TOKEN = "deploy-integration-token"
SCRAPE_INTERVAL_S = 1
# What Grafana's $__rate_interval becomes here: >= 4 scrape intervals, as Grafana computes it.
RATE_WINDOW = "15s"
# The dashboard's template variables at "All" (Grafana substitutes the variable's allValue).
ALL_VALUES = {"$namespace": ".*", "$job": ".*", "$trainer": ".*"}
START_TIMEOUT_S = 60.0
RL_TIMEOUT_S = 300.0  # the short RL run below takes well under a minute on 2 CPU cores
RL_STEPS = 6
REDIS_MAXMEMORY_BYTES = 64 << 20  # the RL run's records fit; the flood afterwards does not
FLOOD_RECORD_BYTES = 1 << 20
PROBE_RECORD_BYTES = 4 << 10
KEY_PREFIX = "trace:qc"  # quant-cache's default TRACE_KEY_PREFIX
REPLICAS = ("rollout-a", "rollout-b")
METRIC_NAME = re.compile(r"\btrace_[a-z0-9_]+\b")


def _grafana_substitute(expr: str) -> str:
    """`expr` as Grafana sends it with every template variable at All."""
    for var, value in {"$__rate_interval": RATE_WINDOW, **ALL_VALUES}.items():
        expr = expr.replace(var, value)
    return expr


# -- the dashboard ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PanelQueries:
    title: str
    exprs: tuple[str, ...]


def dashboard_panels() -> list[PanelQueries]:
    return [
        PanelQueries(p["title"], tuple(t["expr"] for t in p["targets"]))
        for p in json.loads(DASHBOARD.read_text())["panels"]
        if p["type"] != "row"
    ]


PANELS = dashboard_panels()


# -- processes ----------------------------------------------------------------------------
class Served(LocalService):
    """`trace-rl serve <name>` (the console script containers run) on loopback ports."""

    def __init__(
        self, name: str, env: dict[str, str], workdir: pathlib.Path, *, label: str = ""
    ) -> None:
        exe = pathlib.Path(sys.executable).with_name("trace-rl")
        assert exe.exists(), f"console script {exe} missing: pip install -e ."
        env = {"TRACE_AUTH_TOKEN": TOKEN, **env}
        self.service = name  # the serve target; `name` (the label) names its log file
        super().__init__(label or name, name, env, workdir, argv=[str(exe), "serve", name])

    def start(self) -> Served:  # ports only: a rollout is not SERVING before its first weights
        super().start(serving=False, timeout=START_TIMEOUT_S)
        return self

    @property
    def http_target(self) -> str:
        return f"127.0.0.1:{self.http_port}"


class Prometheus:
    """The Debian `prometheus` server on a loopback port. Targets are added while it runs
    (file-based discovery), so it scrapes each service from its first second."""

    JOBS = ("trace-quant-cache", "trace-weight-sync", "trace-trainer", "trace-rollout")

    def __init__(self, workdir: pathlib.Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.targets: dict[str, list[str]] = {job: [] for job in self.JOBS}
        self.config = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": job,
                    "file_sd_configs": [
                        {"files": [str(self._sd_file(job))], "refresh_interval": "1s"}
                    ],
                }
                for job in self.JOBS
            ],
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = workdir / "prometheus.log"
        for job in self.JOBS:
            self._write_targets(job)

    def _sd_file(self, job: str) -> pathlib.Path:
        return self.workdir / f"{job}.targets.json"

    def _write_targets(self, job: str) -> None:
        tmp = self._sd_file(job).with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": self.targets[job]}]))
        os.replace(tmp, self._sd_file(job))  # atomic: Prometheus never reads half a file

    def add(self, job: str, *services: Served) -> None:
        """Scrape these services' /metrics from now on; returns once all are up."""
        self.targets[job] += [s.http_target for s in services]
        self._write_targets(job)
        self.wait_targets_up(sum(len(t) for t in self.targets.values()))

    def start(self) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:  # must not pass by skipping: `make test` installs it
            pytest.fail("prometheus not found: `apt-get install -y prometheus`")
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait(lambda: httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200)
        return self

    def _wait(self, ok: object, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_file.read_text()}")
            try:
                if ok():  # type: ignore[operator]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout}s:\n{self.log_file.read_text()}")

    def wait_targets_up(self, n: int) -> None:
        def all_up() -> bool:
            active = httpx.get(f"{self.url}/api/v1/targets", timeout=2).json()["data"]
            up = [t for t in active["activeTargets"] if t["health"] == "up"]
            return len(up) >= n

        self._wait(all_up)

    def query(self, expr: str) -> list[dict]:
        res = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = res.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        """What a Grafana panel plots over [start, end] (one point per scrape interval)."""
        params = {"query": expr, "start": start, "end": end, "step": SCRAPE_INTERVAL_S}
        body = httpx.get(f"{self.url}/api/v1/query_range", params=params, timeout=30).json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def metric_names(self) -> set[str]:
        res = httpx.get(f"{self.url}/api/v1/label/__name__/values", timeout=10)
        return set(res.json()["data"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- traffic besides the RL run ---------------------------------------------------------
class RecordProbe(threading.Thread):
    """Puts small records of its own run on quant-cache and reads them back, asks for one
    that was never written and reads one corrupted in Redis, until `stop` is set. Through
    the service's gRPC path: the lookups panel counts that path (the direct path's data-plane
    Redis user may not write the service's stats)."""

    def __init__(self, qc: Served, raw: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.client = QuantCacheClient(qc.grpc_address, TOKEN, data_path="grpc")
        self.raw = raw
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.counts = {"put": 0, "got": 0, "corrupt": 0}

    def run(self) -> None:
        try:
            blob = os.urandom(PROBE_RECORD_BYTES)
            round_ = 0
            while not self.stop.is_set():
                ids = [f"p{round_}-{i}" for i in range(4)]
                for sid in ids:
                    self.client.put_records("deploy-probe", 0, sid, blob)
                    self.counts["put"] += 1
                self.raw.setrange(f"{KEY_PREFIX}:deploy-probe:0:{ids[0]}", 20, b"\xff\xff")
                with pytest.raises(CorruptRecordError):
                    self.client.get_records("deploy-probe", 0, ids)
                self.counts["corrupt"] += 1
                got = self.client.get_records("deploy-probe", 0, [*ids[1:], "never-written"])
                self.counts["got"] += len(got)
                round_ += 1
                self.stop.wait(0.5)
        except BaseException as exc:  # reported by the fixture
            self.error = exc


def flood_until_evicted(qc: Served, raw: redis.Redis) -> int:
    """Put 1 MiB records until Redis has evicted some at its memory bound; returns how many."""
    client = QuantCacheClient(qc.grpc_address, TOKEN)
    before = int(raw.info("stats")["evicted_keys"])
    blob = os.urandom(FLOOD_RECORD_BYTES)
    for i in range(4 * REDIS_MAXMEMORY_BYTES // FLOOD_RECORD_BYTES):
        client.put_records("deploy-flood", 0, f"f{i}", blob)
        evicted = int(raw.info("stats")["evicted_keys"]) - before
        if evicted > 0 and i * FLOOD_RECORD_BYTES > REDIS_MAXMEMORY_BYTES:
            return evicted
    raise AssertionError("Redis never evicted: is maxmemory set?")


def wait_trainer_finished(trainer: Served, procs: list[Served]) -> dict:
    deadline = time.monotonic() + RL_TIMEOUT_S
    status: dict = {}
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"http://{trainer.http_target}/status", timeout=5).json()
        except httpx.HTTPError:
            status = {}
        if status.get("state") == "finished":
            return status
        if status.get("state") == "failed" or any(
            p.proc and p.proc.poll() is not None for p in procs
        ):
            break
        time.sleep(1)
    logs = "\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in procs)
    raise AssertionError(f"RL run did not finish: {status}\n{logs}")


# -- the fixture --------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    results: dict[str, list[dict]]  # expr -> range-query result over the whole run
    exported: set[str]
    counts: dict[str, int]
    trainer_status: dict
    http_ports: dict[str, int]  # a running process per service name


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    with tempfile.TemporaryDirectory(prefix="trace-deploy-") as tmp:
        workdir = pathlib.Path(tmp)
        procs: list[Served] = []
        prom = Prometheus(workdir)
        with LocalRedis(LocalRedisConfig(maxmemory_bytes=REDIS_MAXMEMORY_BYTES)) as local_redis:
            try:
                prom.start()
                start = time.time()
                qc = Served("quant-cache", {"TRACE_REDIS_URL": local_redis.url}, workdir).start()
                ws = Served("weight-sync", {}, workdir).start()
                procs += [qc, ws]
                prom.add("trace-quant-cache", qc)
                prom.add("trace-weight-sync", ws)
                stores = {
                    "TRACE_QUANT_CACHE_ADDRESS": qc.grpc_address,
                    "TRACE_WEIGHT_SYNC_ADDRESS": ws.grpc_address,
                }
                rollouts = [
                    Served("rollout", {**stores, "TRACE_REPLICA_ID": rid}, workdir, label=rid)
                    for rid in REPLICAS
                ]
                procs += [r.start() for r in rollouts]
                prom.add("trace-rollout", *rollouts)
                raw = redis.Redis.from_url(local_redis.url)
                probe = RecordProbe(qc, raw)
                probe.start()
                # The trainer last: Prometheus already scrapes everything when its run begins.
                trainer = Served("trainer", trainer_env(stores, workdir), workdir)
                procs.append(trainer.start())
                prom.add("trace-trainer", trainer)
                status = wait_trainer_finished(trainer, procs)
                evicted = flood_until_evicted(qc, raw)
                time.sleep(3 * SCRAPE_INTERVAL_S)  # the probe keeps going; scrape the end
                probe.stop.set()
                probe.join(timeout=30)
                assert probe.error is None, f"record probe failed: {probe.error!r}"
                end = time.time()
                results = {
                    expr: prom.query_range(_grafana_substitute(expr), start, end)
                    for panel in PANELS
                    for expr in panel.exprs
                }
                yield Run(
                    results,
                    prom.metric_names(),
                    {**probe.counts, "evicted": evicted},
                    status,
                    {p.service: p.http_port for p in procs},
                )
            finally:
                prom.stop()
                for p in reversed(procs):
                    p.stop()


def trainer_env(stores: dict[str, str], workdir: pathlib.Path) -> dict[str, str]:
    """A short run of the tiny model, a few steps of 4 prompts x 4 completions, as the recipe
    `workdir/run.toml` (TRACE_RECIPE, as a deployment mounts one), and the trainer's wiring."""
    recipe = workdir / "run.toml"
    recipe.write_text(
        f'run_id = "deploy"\nsteps = {RL_STEPS}\nprompts_per_step = 4\ngroup_size = 4\n'
        "[dispatch]\nprompts_per_unit = 1\n"
        '[guidance]\nmode = "full"\n'  # D_act and code flips need full records
    )
    return {
        **stores,
        "TRACE_RECIPE": str(recipe),
        "TRACE_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "TRACE_METRICS_FILE": str(workdir / "metrics.jsonl"),
    }


# -- the checks ---------------------------------------------------------------------------
def _finite(result: list[dict]) -> list[float]:
    """Every finite value of every series of a range-query result."""
    return [float(v) for series in result for _, v in series["values"] if math.isfinite(float(v))]


def test_the_run_exercised_every_path(run: Run) -> None:
    assert run.trainer_status["step"] == RL_STEPS, run.trainer_status
    assert run.trainer_status["policy_version"] == RL_STEPS, run.trainer_status
    c = run.counts
    assert c["put"] > 0 and c["corrupt"] > 0 and c["evicted"] > 0, c


def test_a_missing_metric_is_caught(run: Run) -> None:
    """The check below can fail: a metric nobody exports is not in Prometheus."""
    assert "trace_quant_cache_no_such_metric_total" not in run.exported
    assert "trace_trainer_step" in run.exported


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: p.title)
def test_panel_returns_data(run: Run, panel: PanelQueries) -> None:
    names = {n for e in panel.exprs for n in METRIC_NAME.findall(e)}
    unknown = sorted(names - run.exported)
    assert not unknown, f"{panel.title}: metrics no service exports: {unknown}"
    for expr in panel.exprs:
        assert _finite(run.results[expr]), f"{panel.title}: no data for {expr!r}"


def test_the_numbers_moved(run: Run) -> None:
    """Not just present: the traffic shows in what the dashboard plots."""
    by_title = {p.title: p.exprs for p in PANELS}

    def peak(expr: str) -> float:
        return max(_finite(run.results[expr]), default=0.0)

    per_replica, total_tps = (
        by_title["Rollout tokens/s per replica"][0],
        by_title["Rollout tokens/s, all replicas"][0],
    )
    assert peak(total_tps) > 0
    assert {s["metric"]["instance"] for s in run.results[per_replica]} == {
        s["metric"]["instance"] for s in run.results[by_title["Generate requests in flight"][0]]
    }
    assert len(run.results[per_replica]) == len(REPLICAS)
    hits, misses, corrupt, evicted, _expired, _swept = by_title[
        "quant-cache hits / misses / evictions"
    ]
    for expr in (hits, misses, corrupt, evicted):
        assert peak(expr) > 0, expr
    push_s, pull_s, _last_pull = by_title["Weight push / pull seconds"]
    assert peak(push_s) > 0 and peak(pull_s) > 0
    versions = by_title["Weight version per replica"]
    assert peak(versions[0]) == RL_STEPS  # latest version on weight-sync
    assert {s["metric"]["replica_id"] for s in run.results[versions[1]]} == set(REPLICAS)
    phases = run.results[by_title["Step time split"][0]]
    assert {s["metric"]["phase"] for s in phases} == {"rollout", "records", "train", "push"}
    assert run.results[by_title["D_act per layer"][0]], "full records: D_act per layer"


def test_compose_commands_work(run: Run) -> None:
    """The commands docker-compose.yml runs inside the containers, run here against the live
    services: the /readyz healthcheck (exit 0 on a ready service, non-zero on a dead port) and
    the rollout entrypoint wrapper (sets TRACE_ADVERTISE_HOST, then execs trace-rl)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    bin_dir = str(pathlib.Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    for name in ("quant-cache", "weight-sync", "trainer", "rollout"):
        check = compose["services"][name]["healthcheck"]["test"]
        assert check[0] == "CMD" and check[1] == "python", check
        argv = [sys.executable, *check[2:]]
        ok = subprocess.run(
            argv, env={**env, "TRACE_HTTP_PORT": str(run.http_ports[name])}, timeout=30
        )
        assert ok.returncode == 0, f"{name}: healthcheck failed on a ready service"
    dead = subprocess.run(
        argv, env={**env, "TRACE_HTTP_PORT": str(free_port())}, capture_output=True, timeout=30
    )
    assert dead.returncode != 0, "the healthcheck passed on a port nobody listens on"
    entrypoint = compose["services"]["rollout"]["entrypoint"]
    script = entrypoint[2].replace("$$", "$")  # compose's escape for a literal `$`
    res = subprocess.run(
        [*entrypoint[:2], script, *entrypoint[3:], "version"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    want = importlib.metadata.version("trace-rl")
    assert res.returncode == 0 and res.stdout.strip() == want, res.stdout + res.stderr
