"""The whole system on one machine: a local Redis, quant-cache, weight-sync, the trainer and
N rollout replicas, each a child process (what `trace-rl demo` and the e2e tests run).

The trainer's run is a recipe, as in a deployment: `ClusterConfig.run` (dotted or nested keys,
or a RunConfig) is written as a TOML file in the cluster's directory and named by
TRACE_RECIPE; the `*_env` maps are wiring only (a run key there is refused)."""

from __future__ import annotations

import pathlib
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx

from trace_common.config import (
    RECIPE_ENV,
    RunConfig,
    check_no_run_env,
    dump_toml,
    flatten,
    recipe_of,
)
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from trace_common.service.grpc_server import AUTH_HEADER
from trace_common.service.process import LocalService
from trace_common.stores.redis_local import LocalRedis, LocalRedisConfig

STATUS_TIMEOUT_S = 5.0


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """What to start: the trainer's run, and extra `TRACE_*` settings (wiring) per service."""

    replicas: int = 2
    heartbeat_timeout_s: float = 3.0  # weight-sync reports a silent replica dead after this
    redis_maxmemory_bytes: int = 256 << 20
    redis_password: str | None = None  # None: a random one (LocalRedisConfig.password)
    # The trainer's run: recipe keys, dotted or nested ({"steps": 3, "task.name": "reverse"}),
    # or a RunConfig; written as the trainer's recipe (TRACE_RECIPE). Empty: the defaults.
    run: Mapping[str, Any] | RunConfig = field(default_factory=dict)
    trainer_env: Mapping[str, str] = field(default_factory=dict)
    rollout_env: Mapping[str, str] = field(default_factory=dict)
    # TRACE_DEVICE of replica i (e.g. ["cuda:1", "cuda:1"]); empty: rollout_env's for all
    rollout_devices: Sequence[str] = ()
    # replaces `python -m services.trainer` (e.g. torchrun for N learner ranks)
    trainer_argv: Sequence[str] | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        check_no_run_env(self.trainer_env)
        self.run = recipe_of(self.run)  # a bad key or value: ConfigError here, not in a child
        if self.rollout_devices and len(self.rollout_devices) != self.replicas:
            raise ValueError(
                f"rollout_devices {list(self.rollout_devices)} must name one device per "
                f"replica ({self.replicas})"
            )


class LocalCluster:
    """Start with ``start()`` (or as a context manager); ``stop()`` stops everything."""

    def __init__(self, config: ClusterConfig, log_dir: pathlib.Path) -> None:
        self.config = config
        self.log_dir = log_dir
        self.redis: LocalRedis | None = None
        self.quant_cache: LocalService | None = None
        self.weight_sync: LocalService | None = None
        self.trainer: LocalService | None = None
        self.rollouts: list[LocalService] = []
        self.trainer_starts = 0

    def _common(self) -> dict[str, str]:
        assert self.quant_cache is not None and self.weight_sync is not None
        return {
            "TRACE_AUTH_TOKEN": self.config.token,
            "TRACE_WEIGHT_SYNC_ADDRESS": self.weight_sync.grpc_address,
            "TRACE_QUANT_CACHE_ADDRESS": self.quant_cache.grpc_address,
        }

    def start(self) -> LocalCluster:
        cfg = self.config
        try:
            self.redis = LocalRedis(
                LocalRedisConfig(
                    maxmemory_bytes=cfg.redis_maxmemory_bytes, password=cfg.redis_password
                )
            ).start()
            token = {"TRACE_AUTH_TOKEN": cfg.token}
            self.quant_cache = LocalService(
                "quant-cache", "services.quant_cache",
                {**token, "TRACE_REDIS_URL": self.redis.url}, self.log_dir,
            ).launch()  # fmt: skip
            self.weight_sync = self._weight_sync(port=0).launch()
            for svc in (self.quant_cache, self.weight_sync):
                svc.wait_ports().wait_serving()
            self.start_trainer()
            for i in range(cfg.replicas):
                self.rollouts.append(self._rollout(i).launch())
            for r in self.rollouts:
                r.wait_ports()
            assert self.trainer is not None
            self.trainer.wait_serving()
            for r in self.rollouts:
                r.wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _weight_sync(self, port: int) -> LocalService:
        env = {
            "TRACE_AUTH_TOKEN": self.config.token,
            "TRACE_HEARTBEAT_TIMEOUT_SECONDS": str(self.config.heartbeat_timeout_s),
            "TRACE_GRPC_PORT": str(port),
        }
        return LocalService("weight-sync", "services.weight_sync", env, self.log_dir)

    def restart_weight_sync(self, *, down_s: float = 0.0) -> LocalService:
        """Kill weight-sync (SIGKILL: it loses its versions and registry) and start a fresh
        one on the same gRPC port after `down_s` seconds (the chaos tests)."""
        assert self.weight_sync is not None
        port = self.weight_sync.grpc_port
        self.weight_sync.kill()
        time.sleep(down_s)
        self.weight_sync = self._weight_sync(port).start()
        return self.weight_sync

    def restart_redis(self, *, down_s: float = 0.0) -> LocalRedis:
        """Kill Redis (SIGKILL) and start an empty one (nothing is persisted: every record is
        lost) on the same port with the same password after `down_s` seconds (chaos tests)."""
        assert self.redis is not None
        old = self.redis
        config = LocalRedisConfig(
            maxmemory_bytes=self.config.redis_maxmemory_bytes, port=old.port, password=old.password
        )
        old.kill()
        time.sleep(down_s)
        self.redis = LocalRedis(config).start()
        return self.redis

    def restart_replica(self, i: int) -> LocalService:
        """Kill rollout replica `i` and start a fresh one with the same id (no weights)."""
        self.rollouts[i].kill()
        self.rollouts[i] = self._rollout(i).launch().wait_ports()
        return self.rollouts[i]

    def _rollout(self, i: int) -> LocalService:
        env = {**self._common(), "TRACE_REPLICA_ID": f"rollout-{i}", **self.config.rollout_env}
        if self.config.rollout_devices:
            env["TRACE_DEVICE"] = self.config.rollout_devices[i]
        return LocalService(f"rollout-{i}", "services.rollout", env, self.log_dir)

    def start_trainer(
        self,
        *,
        wait: bool = False,
        run: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        argv: Sequence[str] | None = None,
    ) -> LocalService:
        """(Re)start the trainer process: the configured run with the recipe keys of ``run``
        on top (dotted or nested), written as ``trainer-N.toml`` in the cluster's directory;
        the configured settings, then ``env`` overrides; ``argv`` (default: the config's
        ``trainer_argv``) replaces ``python -m services.trainer`` (e.g. torchrun for N
        ranks)."""
        check_no_run_env(env or {})
        recipe = recipe_of({**flatten(self.config.run), **flatten(run or {})})
        self.trainer_starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"trainer-{self.trainer_starts}.toml"
        path.write_text(dump_toml(recipe))
        env = {
            **self._common(),
            **self.config.trainer_env,
            **(env or {}),
            RECIPE_ENV: str(path),
        }
        argv = argv if argv is not None else self.config.trainer_argv
        self.trainer = LocalService(
            "trainer", "services.trainer", env, self.log_dir, argv=argv
        ).launch()
        self.trainer.wait_ports()
        if wait:
            self.trainer.wait_serving()
        return self.trainer

    def trainer_status(self) -> dict:
        assert self.trainer is not None
        return httpx.get(f"{self.trainer.http_url}/status", timeout=STATUS_TIMEOUT_S).json()

    def auth_metadata(self) -> tuple[tuple[str, str]]:
        """The gRPC metadata that authenticates a call to any of the cluster's services."""
        return ((AUTH_HEADER, f"Bearer {self.config.token}"),)

    def trainer_stub(self) -> trainer_pb2_grpc.TrainerStub:
        assert self.trainer is not None
        return trainer_pb2_grpc.TrainerStub(grpc.insecure_channel(self.trainer.grpc_address))

    def pause_trainer(self, reason: str) -> None:
        """Ask the trainer to stop between steps (`settled_status` waits for that)."""
        req = trainer_pb2.PauseRequest(reason=reason)
        self.trainer_stub().Pause(req, metadata=self.auth_metadata(), timeout=10)

    def resume_trainer(self) -> None:
        req = trainer_pb2.ResumeRequest()
        self.trainer_stub().Resume(req, metadata=self.auth_metadata(), timeout=10)

    def settled_status(self, quiet_s: float = 2.0) -> dict:
        """The paused trainer's status once its step in flight (if any) has finished: "paused"
        is reported at once, the loop stops between steps."""
        st = self.trainer_status()
        while True:
            time.sleep(quiet_s)
            now = self.trainer_status()
            if (now["step"], now["policy_version"]) == (st["step"], st["policy_version"]):
                return now
            st = now

    def processes(self) -> dict[str, int]:
        """The process id of every service running now, by name (Redis as "redis")."""
        services = [self.quant_cache, self.weight_sync, self.trainer, *self.rollouts]
        out = {s.name: s.proc.pid for s in services if s is not None and s.proc and s.alive()}
        if self.redis is not None and self.redis.pid is not None:
            out["redis"] = self.redis.pid
        return out

    def stop(self) -> None:
        for svc in [*self.rollouts, self.trainer, self.weight_sync, self.quant_cache]:
            if svc is not None:
                svc.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
